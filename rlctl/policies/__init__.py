"""Rollback policies: the schema of policy files (rules in ``schema``, ``triggers``, ``actions``; the
``when`` expressions in ``expr`` and ``expr_parser``), their loader, and the per-step evaluator.

Pure Python (pydantic, yaml, the standard library): never imports torch or ``rlctl.engine``. The trainer
feeds each step's metrics row to ``PolicyEngine.evaluate`` and carries out the actions of the firings.
Ready-made YAML policies ship inside the package (``ready/``; the repository's top-level ``policies/``
links there), so a bare name such as ``default`` works from any install.
"""

from rlctl.policies.evaluator import Firing, PolicyEngine, firing_event, is_healthy
from rlctl.policies.expr import Expression
from rlctl.policies.expr_parser import parse_expression
from rlctl.policies.loader import load_policies, load_policy_file, validate_policy
from rlctl.policies.schema import PolicyFile, Rule, rule_metrics

__all__ = [
    "Expression",
    "Firing",
    "PolicyEngine",
    "PolicyFile",
    "Rule",
    "firing_event",
    "is_healthy",
    "load_policies",
    "load_policy_file",
    "parse_expression",
    "rule_metrics",
    "validate_policy",
]
