"""What a multi-turn rollout keeps of each conversation, the batch it makes of them and its metrics.

A conversation's ids are everything after its prompt: the model's tokens (``model``: True, with their
log-probs) and the tools' or the environment's, with the template's boundary tokens (False). The batch's
``response_mask`` is 1 on the model's tokens of conversations without an infrastructure failure; its
``turn_rewards`` hold an environment's reward of each turn on that turn's last token of the model's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from rlctl.engine.batch import Sequences
from rlctl.engine.dist import MAX, MEAN
from rlctl.engine.rollout.offers import EVERY_TOOL, Offer
from rlctl.errors import InputError

# How the ranks reduce the metrics of a step's conversations (tool/<name>/calls: SUM, the rollout's
# ``reductions``).
MULTI_TURN_REDUCTIONS = {
    "multi_turn/num_turns/mean": MEAN,
    "multi_turn/num_turns/max": MAX,
    "multi_turn/max_turns_reached_frac": MEAN,
    "multi_turn/env_token_frac": MEAN,
    "multi_turn/template_drift_frac": MEAN,
    "multi_turn/infra_masked_frac": MEAN,
    "tool/calls/mean": MEAN,
    "tool/error_frac": MEAN,
    "tool/invalid_call_frac": MEAN,
    "tool/timeout_frac": MEAN,
    "tool/unavailable_frac": MEAN,
    "timing_s/tools": MAX,
}
# With an environment: the mean over conversations of the rewards it gave their turns.
ENVIRONMENT_REDUCTIONS = {"multi_turn/turn_reward/mean": MEAN}


@dataclass
class Conversation:
    """One trajectory: its ids after the prompt, which are the model's, its messages (for the drift
    check) and what happened."""

    prompt: str
    seed: tuple[int, int]  # (prompt index, sample index)
    ids: list[int] = field(default_factory=list)
    model: list[bool] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)
    turns: int = 0
    done: bool = False
    max_turns_reached: bool = False
    infra_failed: bool = False
    calls: list[dict[str, Any]] = field(default_factory=list)  # turn, name, arguments, outcome, answer
    offer: Offer = EVERY_TOOL  # the tools its prompt's row offers it, and their hidden arguments
    drift_at: int | None = None  # the drift check's first differing position (None: none)
    env_args: dict[str, Any] = field(default_factory=dict)  # the environment's reset() arguments (its row's)
    # the arguments of the calls each of its objects (a stateful tool, the environment) answered, in order
    history: dict[str, list[Any]] = field(default_factory=dict)
    turn_rewards: list[tuple[int, float]] = field(default_factory=list)  # (position in ids, the environment's)
    turn_ends: list[int | None] = field(default_factory=list)  # each model turn's last position (None: empty)

    @property
    def model_tokens(self) -> int:
        return sum(self.model)

    def add_turn(self, tokens: list[int], log_probs: list[float]) -> None:
        """A turn of the model's: its tokens and their log-probs appended, its end remembered."""
        self.ids += tokens
        self.model += [True] * len(tokens)
        self.log_probs += log_probs
        self.turns += 1
        self.turn_ends.append(len(self.ids) - 1 if tokens else None)

    def last_model_position(self) -> int | None:
        """The position of its last token of the model's so far (None: none yet)."""
        return next((i for i in range(len(self.model) - 1, -1, -1) if self.model[i]), None)


@dataclass
class ToolStats:
    calls: int = 0  # attempts: well-formed or not (an environment's steps)
    errors: int = 0
    invalid: int = 0
    timeouts: int = 0
    unavailable: int = 0
    replayed: int = 0  # answers read from the run's record (a step run again), not asked of the tool
    seconds: float = 0.0
    by_name: dict[str, int] = field(default_factory=dict)
    own: dict[str, float] = field(default_factory=dict)  # the tools' own metrics (their call_metrics), summed


def batch_of(enc: dict[str, torch.Tensor], convs: list[Conversation], pad: int) -> Sequences:
    """The prompts as encoded, each conversation's ids after them (right-padded); the mask on the model's
    tokens of conversations without an infrastructure failure, and their turn rewards (None when no
    conversation has one)."""
    T = max(1, max(len(c.ids) for c in convs))
    device = enc["input_ids"].device
    resp = torch.full((len(convs), T), pad, dtype=enc["input_ids"].dtype)
    attn, mask = torch.zeros(len(convs), T, dtype=torch.long), torch.zeros(len(convs), T, dtype=torch.long)
    lps, rewards = torch.zeros(len(convs), T), torch.zeros(len(convs), T)
    for i, c in enumerate(convs):
        n = len(c.ids)
        resp[i, :n] = torch.tensor(c.ids, dtype=resp.dtype)
        attn[i, :n] = 1
        if not c.infra_failed:
            mask[i, :n] = torch.tensor(c.model, dtype=torch.long)
            for position, reward in c.turn_rewards:
                rewards[i, position] += reward
        lps[i, :n] = torch.tensor(c.log_probs) * mask[i, :n]
    input_ids = torch.cat([enc["input_ids"], resp.to(device)], dim=1)
    attention = torch.cat([enc["attention_mask"], attn.to(device)], dim=1)
    turn_rewards = rewards.to(device) if any(c.turn_rewards for c in convs) else None
    return Sequences(input_ids, attention, mask.to(device), enc["input_ids"].shape[1], lps.to(device), turn_rewards)


def metrics_row(convs: list[Conversation], stats: ToolStats, drifted: int, environment: bool) -> dict[str, float]:
    """The metrics of one generate call (``_n``: its conversations, the weight of its means)."""
    n, calls = len(convs), max(stats.calls, 1)
    tokens = sum(len(c.ids) for c in convs)
    row = {
        "_n": n,
        "multi_turn/num_turns/mean": sum(c.turns for c in convs) / n,
        "multi_turn/num_turns/max": max(c.turns for c in convs),
        "multi_turn/max_turns_reached_frac": sum(c.max_turns_reached for c in convs) / n,
        "multi_turn/env_token_frac": sum(len(c.ids) - c.model_tokens for c in convs) / max(tokens, 1),
        "multi_turn/template_drift_frac": drifted / n,
        "multi_turn/infra_masked_frac": sum(c.infra_failed for c in convs) / n,
        "tool/calls/mean": stats.calls / n,
        "tool/error_frac": stats.errors / calls,
        "tool/invalid_call_frac": stats.invalid / calls,
        "tool/timeout_frac": stats.timeouts / calls,
        "tool/unavailable_frac": stats.unavailable / calls,
        "timing_s/tools": stats.seconds,
        **{f"tool/{name}/calls": float(k) for name, k in stats.by_name.items()},
        **stats.own,
    }
    if environment:
        row["multi_turn/turn_reward/mean"] = sum(r for c in convs for _, r in c.turn_rewards) / n
    return row


def add_turn_rewards(seqs, turns: list[list[float] | None] | None, ends, who: str) -> torch.Tensor | None:
    """Place a reward function's rewards of single turns (``turns``; None: it gave none) beside those an
    environment gave (``seqs.turn_rewards``, updated), and return each completion's sum of them (B,) on the
    CPU, part of its score; None when no turn has a reward."""
    if turns is not None and any(turns):
        placed = turn_reward_tensor(turns, ends, seqs.response_mask, who)
        seqs.turn_rewards = placed if seqs.turn_rewards is None else seqs.turn_rewards + placed
    return seqs.turn_rewards.sum(-1).cpu() if seqs.turn_rewards is not None else None


def turn_reward_tensor(
    turns: list[list[float] | None], ends: list[list[int | None]], mask: torch.Tensor, who: str
) -> torch.Tensor:
    """(B, T) the rewards a reward function gave single turns (``turns[i][k]``: conversation i's k-th turn
    of the model's) on those turns' last tokens (``ends``; an empty turn's on the conversation's last token
    of the model's), 0 for a conversation masked whole. More rewards than turns is an InputError naming
    ``who`` and the completion."""
    out = torch.zeros(mask.shape, dtype=torch.float32)
    last = [max((i for i, m in enumerate(row) if m), default=None) for row in mask.cpu().tolist()]
    for i, rewards in enumerate(turns):
        if not rewards:
            continue
        if len(rewards) > len(ends[i]):
            raise InputError(
                f"{who} gave completion {i} {len(rewards)} turn rewards, but its conversation has "
                f"{len(ends[i])} turn(s) of the model's"
            )
        for k, reward in enumerate(rewards):
            at = ends[i][k] if ends[i][k] is not None else last[i]
            if last[i] is not None and at is not None:
                out[i, at] += reward
    return out.to(mask.device)
