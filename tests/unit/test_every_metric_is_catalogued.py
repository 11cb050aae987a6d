"""The metric catalogue: every metric the engine declares is in it (read from the engine's source, so a
new metric fails here until it is catalogued), patterns match what they stand for, and typos get a
"did you mean". (The keys of a real run are checked in tests/e2e/test_policy_tools_e2e.py.)"""

import ast
import re
from pathlib import Path

from rlctl.config import RunConfig
from rlctl.numbers import NOT_METRICS
from rlctl.policies import validate_policy
from rlctl.policies.catalogue import (
    DESCRIPTIONS,
    PATTERNS,
    ROW_KEYS,
    SECTIONS,
    known_metric,
    meaning,
    suggest,
    unknown_metrics,
)

ENGINE = Path(__file__).resolve().parents[2] / "rlctl" / "engine"
NOT_IN_ROWS = {"perf/tokens"}  # Trainer.record folds it into perf/tokens_seen


def declared_metrics() -> dict[str, set[str]]:
    """The string keys of every module-level ``*REDUCTIONS`` dict literal in rlctl/engine, by file."""
    found: dict[str, set[str]] = {}
    for path in ENGINE.rglob("*.py"):
        for node in ast.parse(path.read_text()).body:
            targets = (
                node.targets
                if isinstance(node, ast.Assign)
                else [node.target]
                if isinstance(node, ast.AnnAssign)
                else []
            )
            names = [t.id for t in targets if isinstance(t, ast.Name)]
            if any(n.endswith("REDUCTIONS") for n in names) and isinstance(node.value, ast.Dict):
                keys = {k.value for k in node.value.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
                found.setdefault(path.name, set()).update(keys)
    return found


def test_every_metric_the_engine_declares_is_catalogued():
    declared = declared_metrics()
    assert {"actor.py", "critic.py", "experience.py", "step.py"} <= set(declared)  # the scan sees them
    assert "actor/ppo_kl" in declared["actor.py"] and "critic/score/mean" in declared["experience.py"]
    missing = sorted(k for keys in declared.values() for k in keys - NOT_IN_ROWS if not known_metric(k))
    assert missing == [], (
        "add these to a section of rlctl/policies/catalogue.py SECTIONS with a one-line meaning, then run "
        f".venv/bin/python docs/gen_metrics.py: {missing}"
    )


def test_every_key_is_in_one_section_and_the_row_keys_are_no_metrics():
    """docs/metrics.md has a table per section: a key given twice would be told twice, one meaning lost."""
    assert sum(len(keys) for keys in SECTIONS.values()) == len(DESCRIPTIONS) + len(PATTERNS)
    assert all(SECTIONS.values())
    assert set(ROW_KEYS) == NOT_METRICS and not any(known_metric(k) for k in ROW_KEYS)
    assert "critic/score/<name>/truncated_frac" in PATTERNS and known_metric("critic/score/rm/truncated_frac")


def test_validation_and_timing_keys_match_their_patterns():
    for key in ("val/score/mean", "val/score/mean@4", "val/score/best@16", "val/gsm8k/score/mean"):
        assert known_metric(key), key
    assert known_metric("timing_s/update_actor") and known_metric("timing_s/validation")
    assert not known_metric("timing_s/") and not known_metric("timing_s/gen/x")
    assert not known_metric("actor/ppo_kll") and not known_metric("val/score/mean@")
    assert meaning("val/gsm8k/score/mean") == PATTERNS["val/<data_source>/score/mean"]
    # a data_source is written as the data holds it, slashes included (a Hub name like openai/gsm8k)
    assert known_metric("val/openai/gsm8k/score/mean") and not known_metric("val//score/mean")
    assert meaning("val/openai/gsm8k/score/mean") == PATTERNS["val/<data_source>/score/mean"]
    assert "use_kl_loss" not in DESCRIPTIONS["actor/kl_loss"] and "algorithm.kl_coef" in DESCRIPTIONS["actor/kl_loss"]
    assert all(text and "\n" not in text for text in [*DESCRIPTIONS.values(), *PATTERNS.values()])


def test_globs_are_known_when_they_match_something():
    assert known_metric("*") and known_metric("actor/*") and known_metric("timing_s/*")
    assert not known_metric("actr/*")


def test_suggest_names_the_nearest_key():
    assert suggest("actor/ppo_kll") == "actor/ppo_kl"
    assert suggest("actor/grad_nrom") == "actor/grad_norm"
    assert suggest("entirely/else/zzz") is None
    assert suggest("actor/ppo_kll", ["actor/ppo_kl_mine"]) == "actor/ppo_kl_mine"


def test_unknown_metrics_of_rules():
    rules = validate_policy(
        {
            "rules": [
                {"name": "ok", "when": "actor/ppo_kl > 1", "actions": [{"type": "warn"}]},
                {"name": "typo", "when": "actor/ppo_kll > 1", "actions": [{"type": "warn"}]},
                {"name": "nan", "trigger": {"kind": "nonfinite", "metrics": ["actr/*"]}, "actions": [{"type": "warn"}]},
            ]
        }
    ).rules
    found = [(u.rule, u.metric, u.suggestion) for u in unknown_metrics(rules)]
    assert found == [("typo", "actor/ppo_kll", "actor/ppo_kl"), ("nan", "actr/*", None)]
    against_run = [(u.rule, u.metric, u.suggestion) for u in unknown_metrics(rules, {"actor/ppo_kl", "actor/entropy"})]
    assert against_run == [("typo", "actor/ppo_kll", "actor/ppo_kl"), ("nan", "actr/*", None)]
    (missing,) = unknown_metrics(rules[:1], {"actor/ppo_kl_x"})  # rlctl writes it, this run did not
    assert (missing.metric, missing.suggestion, missing.catalogued) == ("actor/ppo_kl", None, True)


def test_the_config_keys_the_meanings_cite_exist():
    cited = {
        k
        for text in [*DESCRIPTIONS.values(), *PATTERNS.values()]
        for k in re.findall(r"\b[a-z_]+\.[a-z_.]*[a-z_]", text)
    }
    assert {"algorithm.kl_coef", "rollout.max_new_tokens"} <= cited
    for key in cited:
        model = RunConfig
        for part in key.split("."):
            assert part in model.model_fields, f"catalogue.py cites {key}, which is no run-config key"
            model = model.model_fields[part].annotation
