"""The catalogue of the metric keys rlctl writes into a run's rows, each with a one-line meaning.

A rule that reads a metric no run writes can never fire; ``rlctl policy check`` warns about such names
with a "did you mean" from this list. Keys are exact (``actor/ppo_kl``) or patterns whose ``<part>``
stands for a name chosen by the run: one path segment (``timing_s/<phase>``), except ``<data_source>``,
a value of the data's data_source column, which may hold slashes itself (``val/openai/gsm8k/score/mean``).
Pure data and string matching: adding a metric to the engine means adding it here
(tests/unit/test_every_metric_is_catalogued.py fails until then). docs/metrics.md is generated from it, one table per
section (docs/gen_metrics.py).
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from functools import cache

from rlctl.policies.schema import Rule, rule_metrics
from rlctl.yamlsrc import closest

# the keys of every row that are not metrics (rlctl.numbers.NOT_METRICS): no rule reads them
ROW_KEYS: dict[str, str] = {
    "step": "steps completed (1-based)",
    "timestamp": "Unix time the step finished (what inspect --check measures staleness by)",
}

# section -> key or pattern -> meaning; a key holding a <part> is a pattern
SECTIONS: dict[str, dict[str, str]] = {
    "the actor's update": {
        "actor/pg_loss": "policy-gradient loss of the actor's update (the clipped surrogate)",
        "actor/kl_loss": "KL to the reference model as a loss term, before its coefficient "
        "(algorithm.kl_coef > 0 without kl_in_reward; else 0)",
        "actor/ppo_kl": "token mean of log pi_old - log pi: the KL between the rollout-time (old) policy and the "
        "updated actor (0 when exactly on-policy)",
        "actor/pg_clipfrac": "share of response tokens whose ratio was clipped",
        "actor/pg_clipfrac_lower": "share of tokens clipped by the dual-clip lower bound (negative advantages)",
        "actor/entropy": "mean entropy of the actor's token distributions over the responses",
        "actor/grad_norm": "the actor's global gradient norm before clipping",
        "actor/lr": "the actor's learning rate at this step",
        "actor/kl_coef": "the KL coefficient used at this step (fixed, scheduled or adaptive)",
        "actor/reward_kl_penalty": "the KL penalty folded into the reward (algorithm.kl_in_reward)",
        "actor/nonfinite/old_log_prob": "count of NaN/Inf old (rollout-time) log-probs over real (unpadded) tokens",
        "actor/nonfinite/ref_log_prob": "count of NaN/Inf reference-model log-probs over real (unpadded) tokens",
        "actor/nonfinite/log_prob": "count of NaN/Inf log-probs of the actor's update over real (unpadded) tokens",
        "actor/nonfinite/loss": "count of NaN/Inf losses of the actor's update",
        "actor/skipped_updates": "updates skipped because their loss or gradient was not finite",
        "actor/loss_scale": "the actor's fp16 loss scale after the step's update (model.dtype: fp16 only)",
        "actor/overflow_skipped": "optimizer steps of the actor's update this step skipped because fp16 gradients "
        "overflowed (model.dtype: fp16 only)",
        "actor/ppo_ratio/max": "largest importance ratio of any response token of the step, before clamp and clip "
        "(1.0 on-policy)",
        "actor/log_prob/min": "smallest log-prob of a sampled response token under the actor",
    },
    "the rollout and its scores": {
        "rollout/logprob_diff": "mean absolute gap between the rollout engine's log-probs of the sampled tokens and "
        "the actor's",
        "rollout_corr/ratio_mean": "mean over response tokens of pi_old / pi_rollout, before the cap "
        "(algorithm.rollout_correction: tis or masked)",
        "rollout_corr/ratio_max": "largest pi_old / pi_rollout of a response token, before the cap "
        "(algorithm.rollout_correction: tis or masked)",
        "rollout_corr/clipfrac": "share of response tokens whose pi_old / pi_rollout the rollout correction capped (tis) "
        "or masked out of the policy loss (masked)",
        "rollout/staleness/mean": "updates between the weights that sampled the step's batch and those it trains "
        "(rollout.mode one_step_off: 1; async: up to rollout.max_staleness; 0 for a batch made at its step)",
        "rollout/staleness/max": "the most updates between the weights that sampled a trajectory of the batch and "
        "those it trains",
        "critic/score/mean": "mean reward-function score of the step's responses",
        "critic/score/max": "highest score of the step's responses",
        "critic/score/min": "lowest score of the step's responses",
        "critic/score/<name>/mean": "mean score of one reward source (reward.sources: its name) over the step's "
        "responses",
        "critic/score/<name>/truncated_frac": "share of the step's prompt + completion texts one reward model source "
        "(reward.sources: its name) saw cut from the left to its context",
        "critic/rewards/mean": "mean total token reward per response (score less any KL penalty)",
        "critic/advantages/mean": "mean advantage over response tokens",
        "critic/advantages/max": "largest advantage of a response token",
        "critic/advantages/min": "smallest advantage of a response token",
        "critic/returns/mean": "mean return over response tokens",
        "response_length/mean": "mean response length in tokens",
        "response_length/max": "longest response of the step, in tokens",
        "response_length/min": "shortest response of the step, in tokens",
        "response_length/clip_ratio": "share of responses cut at rollout.max_new_tokens",
        "prompt_length/mean": "mean prompt length in tokens",
        "response/repetition/mean": "mean over responses of the share of a response's most frequent token",
        "response/repetition/max": "largest share of one token in any response of the step",
        "response/longest_run/mean": "mean over responses of its longest run of one repeated token, as a share of it",
        "response/longest_run/max": "longest run of one repeated token in any response, as a share of it",
        "response/degenerate_frac": "share of responses dominated by one token or one short n-gram",
        "dynamic_sampling/rounds": "generation rounds DAPO's dynamic sampling needed to fill the batch",
        "dynamic_sampling/kept_groups": "groups with a score spread that dynamic sampling kept",
    },
    "the value model": {
        "critic/values/mean": "mean value-model estimate over response tokens (with a critic)",
        "critic/vf_loss": "the value model's loss (with a critic)",
        "critic/vf_clipfrac": "share of value predictions clipped (with a critic)",
        "critic/grad_norm": "the value model's gradient norm (with a critic)",
        "critic/lr": "the value model's learning rate (with a critic)",
        "critic/loss_scale": "the value model's fp16 loss scale after the step's update (model.dtype: fp16 only)",
        "critic/overflow_skipped": "optimizer steps of the value model's update this step skipped because fp16 "
        "gradients overflowed (model.dtype: fp16 only)",
    },
    "multi-turn conversations with tools": {
        "multi_turn/num_turns/mean": "mean number of the model's turns per conversation",
        "multi_turn/num_turns/max": "most turns of the model in one conversation of the step",
        "multi_turn/max_turns_reached_frac": "share of conversations that still called a tool in their last allowed "
        "turn",
        "multi_turn/env_token_frac": "share of the tokens after the prompts that tools and the chat template wrote "
        "(masked)",
        "multi_turn/template_drift_frac": "share of conversations whose ids differ from the whole conversation "
        "re-rendered",
        "multi_turn/infra_masked_frac": "share of conversations masked out of the update after a tool's "
        "infrastructure failed",
        "multi_turn/turn_reward/mean": "rewards an environment gave the turns of a conversation, summed, mean over "
        "the conversations",
        "tool/calls/mean": "tool calls the model tried per conversation (well-formed or not; an environment's steps "
        "count as calls)",
        "tool/<name>/calls": "well-formed calls of one tool (multi_turn tools: its name) in the step",
        "tool/error_frac": "share of tool calls whose tool raised an exception (told to the model)",
        "tool/invalid_call_frac": "share of tool calls that were malformed, named no tool or had bad arguments",
        "tool/timeout_frac": "share of tool calls stopped at their timeout (multi_turn: tool_timeout_s), their worker "
        "killed",
        "tool/unavailable_frac": "share of tool calls whose tool raised ToolUnavailable or whose worker died",
    },
    "the built-in python tool and the code rewards": {
        "tool/python/calls": "well-formed calls of the built-in python tool in the step (replayed ones included)",
        "tool/python/errors": "python tool calls whose code raised or hit a sandbox limit (told to the model)",
        "tool/python/timeouts": "python tool calls stopped by a clock: the sandbox's wall or CPU time, or "
        "tool_timeout_s",
        "tool/python/limit/wall_time": "python tool calls killed at the sandbox's wall_time_s",
        "tool/python/limit/cpu_time": "python tool calls killed at the sandbox's cpu_time_s",
        "tool/python/limit/memory": "python tool calls that ran out of the sandbox's memory_mb",
        "tool/python/limit/processes": "python tool calls that started more processes than the sandbox's processes",
        "tool/python/limit/output": "python tool calls killed for printing more than the sandbox's output_kb",
        "reward/code/tests": "tests the code rewards ran in the step (a case or an assert each)",
        "reward/code/pass_frac": "share of the code rewards' tests of the step that passed (the mean over ranks)",
        "reward/code/timeouts": "code rewards' tests stopped at the sandbox's wall or CPU time (failed)",
        "reward/code/sandbox_s": "seconds the code rewards' tests ran in their sandboxes, summed over the tests",
    },
    "throughput and timing": {
        "perf/throughput": "tokens (prompt + response) per second of step time",
        "perf/tokens_seen": "tokens trained on so far in the run (a running total)",
        "perf/update_padding_frac": "share of the token positions the actor's update computed (rows x columns of "
        "each micro-batch, every epoch) that were padding; actor.max_tokens_per_micro_batch lowers it",
        "timing_s/step": "seconds of the whole step (validation not included)",
        "timing_s/gen": "seconds generating the step's responses, scoring them included",
        "timing_s/tools": "seconds the step's tool calls took (multi-turn; part of timing_s/gen)",
        "timing_s/old_log_prob": "seconds computing the old (rollout-time) log-probs",
        "timing_s/ref": "seconds computing the reference model's log-probs",
        "timing_s/values": "seconds computing the value model's estimates (with a critic)",
        "timing_s/update_critic": "seconds of the value model's update (with a critic)",
        "timing_s/update_actor": "seconds of the actor's update",
        "timing_s/validation": "seconds the step's validation took (validated steps only; not part of timing_s/step)",
        "timing_s/<phase>": "seconds the step spent in a phase",
    },
    "validation": {
        "val/score/mean": "mean score of every validation answer",
        "val/score/mean@<n>": "over validation prompts, the mean of each prompt's n answers' mean score",
        "val/score/best@<n>": "over validation prompts, the mean of each prompt's best score of n answers "
        "(pass@n for 0/1 rewards)",
        "val/response_length/mean": "mean length of the validation answers",
        "val/<data_source>/score/mean": "mean validation score of the prompts of one data_source",
    },
}

DESCRIPTIONS: dict[str, str] = {key: text for keys in SECTIONS.values() for key, text in keys.items() if "<" not in key}
PATTERNS: dict[str, str] = {key: text for keys in SECTIONS.values() for key, text in keys.items() if "<" in key}


MULTI_SEGMENT = frozenset({"<data_source>"})  # parts written as the data holds them, slashes and all


@cache
def _pattern_regex(pattern: str) -> re.Pattern[str]:
    """``timing_s/<phase>`` -> a regex where each ``<part>`` is one non-empty segment (any non-empty
    text for the parts of MULTI_SEGMENT: ``openai/gsm8k``)."""
    parts = re.split(r"(<[^<>]+>)", pattern)
    part = {True: ".+", False: "[^/]+"}
    return re.compile("".join(part[p in MULTI_SEGMENT] if p.startswith("<") else re.escape(p) for p in parts) + r"\Z")


def _samples() -> list[str]:
    """Every exact key, and each pattern with its parts named (``timing_s/phase``): what globs match."""
    return [*DESCRIPTIONS, *(re.sub(r"<([^<>]+)>", r"\1", p) for p in PATTERNS)]


def is_glob(name: str) -> bool:
    """Whether ``name`` is a glob pattern (a nonfinite trigger's ``actor/*``) rather than one key."""
    return any(c in name for c in "*?[")


def known_metric(name: str) -> bool:
    """Whether rlctl writes ``name`` (a key, or a key matching a pattern); a glob is known when it
    matches some key rlctl writes."""
    if is_glob(name):
        return any(fnmatch.fnmatchcase(sample, name) for sample in _samples())
    return name in DESCRIPTIONS or any(_pattern_regex(p).match(name) for p in PATTERNS)


def meaning(name: str) -> str | None:
    """The one-line meaning of a key rlctl writes, or None."""
    if name in DESCRIPTIONS:
        return DESCRIPTIONS[name]
    return next((text for p, text in PATTERNS.items() if _pattern_regex(p).match(name)), None)


def suggest(name: str, keys: list[str] | None = None) -> str | None:
    """The key nearest to a misspelt ``name``: among ``keys`` (a run's own) when given, else among the
    catalogue's keys and patterns; None when nothing is close."""
    return closest(name, keys if keys is not None else [*DESCRIPTIONS, *PATTERNS])


@dataclass(frozen=True)
class UnknownMetric:
    """A metric name a rule reads that no run writes (or that the run checked against never wrote)."""

    rule: str
    metric: str
    suggestion: str | None  # the nearest key, for a typo
    catalogued: bool = False  # checked against a run's keys: rlctl does write it (in other runs)


def unknown_metrics(rules: Iterable[Rule], keys: Collection[str] | None = None) -> list[UnknownMetric]:
    """The metric names ``rules`` read (``rule_metrics``) that are not in the catalogue, or, with
    ``keys`` (a run's own metric keys), not among them; each with a did-you-mean."""
    pool = sorted(keys) if keys is not None else None
    out = []
    for rule in rules:
        for name in rule_metrics(rule):
            if _written(name, pool):
                continue
            catalogued = pool is not None and known_metric(name)
            guess = None if is_glob(name) or catalogued else suggest(name, pool)
            out.append(UnknownMetric(rule.name, name, guess, catalogued))
    return out


def _written(name: str, keys: list[str] | None) -> bool:
    if keys is None:
        return known_metric(name)
    if is_glob(name):
        return any(fnmatch.fnmatchcase(k, name) for k in keys)
    return name in keys
