"""Making experience: prompts -> generations -> scores -> the batch of a step, its advantages and its
batch metrics.

Every rank draws the whole batch of prompts and keeps its share. Each prompt is sampled
``group_size`` times; the reward function scores every completion, the overlong penalty is added, and
with DAPO's dynamic sampling groups whose rewards all tie are dropped and more prompts drawn. Each
metric made here declares how the ranks reduce it (``REDUCTIONS``, ``SAMPLING_REDUCTIONS``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from rlctl import algos, faults
from rlctl.config import AlgorithmConfig, RunConfig
from rlctl.engine.batch import Sequences
from rlctl.engine.data import PromptCursor, columns_of
from rlctl.engine.degeneration import degeneration_metrics
from rlctl.engine.dist import MAX, MEAN, MIN, SUM, Dist
from rlctl.engine.reward import score_completions
from rlctl.engine.reward.sources import recording
from rlctl.engine.rollout import RolloutBackend
from rlctl.engine.rollout.conversation import add_turn_rewards
from rlctl.errors import ConfigError

# How the ranks reduce each metric of ``batch_metrics`` and of dynamic sampling.
REDUCTIONS = {
    "critic/score/mean": MEAN,
    "critic/score/max": MAX,
    "critic/score/min": MIN,
    "critic/rewards/mean": MEAN,
    "critic/advantages/mean": MEAN,
    "critic/advantages/max": MAX,
    "critic/advantages/min": MIN,
    "critic/returns/mean": MEAN,
    "critic/values/mean": MEAN,
    "response_length/mean": MEAN,
    "response_length/max": MAX,
    "response_length/min": MIN,
    "response_length/clip_ratio": MEAN,
    "prompt_length/mean": MEAN,
    "actor/nonfinite/ref_log_prob": SUM,
    "actor/nonfinite/old_log_prob": SUM,
    # every rank holds an equal share of the responses: the mean of the ranks' means is the batch's
    "response/repetition/mean": MEAN,
    "response/repetition/max": MAX,
    "response/longest_run/mean": MEAN,
    "response/longest_run/max": MAX,
    "response/degenerate_frac": MEAN,
}
SAMPLING_REDUCTIONS = {"dynamic_sampling/rounds": MEAN, "dynamic_sampling/kept_groups": SUM}


class Experience:
    """Draws a step's prompts, generates and scores their completions. ``drawn`` holds the dataset
    indices of the prompts of the last batch made (a policy may skip them)."""

    def __init__(
        self,
        cfg: RunConfig,
        data: PromptCursor,
        rollout: RolloutBackend,
        reward_fn: Callable,
        pad_id: int,
        dist: Dist,
        tokenizer=None,
    ):
        """``tokenizer`` names the token of the ``degenerate`` drill (the rollout backend's when None)."""
        self.cfg, self.data, self.rollout, self.reward_fn, self.pad_id, self.dist = (
            cfg,
            data,
            rollout,
            reward_fn,
            pad_id,
            dist,
        )
        self.tokenizer = tokenizer
        self.drawn: list[int] = []
        for fault in faults.active():  # a drill token that is not one token: an error now, not at its step
            if fault.name == "degenerate":
                self.drill_token(fault.value or "")

    def rollout_batch(self, step: int) -> tuple[Sequences, torch.Tensor, dict[str, float]]:
        """``_rollout_rounds``, and with ``reward.sources`` each source's mean score over the completions
        scored for the step (every round of dynamic sampling) as ``critic/score/<name>/mean``, and the
        rollout backend's own metrics of those rounds (``take_metrics``; reduced as its ``reductions``)."""
        with recording(self.reward_fn) as per_source:
            seqs, scores, sampling = self._rollout_rounds(step)
        return seqs, scores, {**sampling, **per_source, **self.rollout.take_metrics()}

    def _rollout_rounds(self, step: int) -> tuple[Sequences, torch.Tensor, dict[str, float]]:
        """Generate and score one batch: its sequences, (B,) scores and the dynamic sampling metrics.
        With DAPO's dynamic sampling, groups whose rewards all tie (no signal) are dropped and more
        prompts are sampled, up to ``max_gen_batches`` rounds; the batch is then cut to
        ``prompts_per_step`` groups. The overlong penalty is added to the scores."""
        a = self.cfg.algorithm
        G, want = a.group_size, self.cfg.trainer.prompts_per_step // self.dist.world
        parts, part_scores, drawn, rounds, kept = [], [], [], 0, 0
        filler: list[tuple[Sequences, torch.Tensor]] = []  # tied groups, to top up a short batch
        drill = faults.once("degenerate", step)  # every round of this step, the first time it runs
        while True:
            seqs, scores = self._generate_round(step, drill)
            drawn += self.drawn
            rounds += 1
            if not a.dynamic_sampling.enabled:
                parts, part_scores = [seqs], [scores]
                break
            live = ~algos.tied_groups(scores, G)
            rows = live.repeat_interleave(G)
            if live.any():
                parts.append(seqs.select(rows))
                part_scores.append(scores[rows])
            if (~live).any():
                filler.append((seqs.select(~rows), scores[~rows]))
            kept += int(live.sum())
            # every rank draws the same prompts each round, so all stop after the same round
            if self.dist.all(kept >= want or rounds >= a.dynamic_sampling.max_gen_batches):
                break
        self.drawn = drawn
        seqs, scores = self._fill(parts, part_scores, filler, kept, want)
        informative = int((~algos.tied_groups(scores, G)).sum()) if a.dynamic_sampling.enabled else 0
        sampling = (
            {"dynamic_sampling/rounds": rounds, "dynamic_sampling/kept_groups": informative}
            if a.dynamic_sampling.enabled
            else {}
        )
        return seqs, scores, sampling

    def _generate_round(self, step: int, drill: str | None = None) -> tuple[Sequences, torch.Tensor]:
        """One round: draw prompts, generate (seeds differ by prompt index), score, add the overlong
        penalty. ``drill``: the ``degenerate`` fault drill's token text ("" for "!"), or None."""
        cfg, a = self.cfg, self.cfg.algorithm
        keys, prompts, columns = self.draw_prompts()
        seqs = self.rollout.generate(prompts, keys, step, columns=columns)
        if drill is not None:
            seqs = repeated_token(seqs, self.drill_token(drill), cfg.rollout.max_new_tokens)
        ends = self.rollout.turn_ends() if drill is None else None
        turns = [None] * len(prompts) if ends is not None else None  # a reward function's of single turns
        scores = self.score(prompts, self.rollout.decode(seqs), {**columns, **self.rollout.reward_columns()}, turns)
        # rewards of single turns (an environment's, the reward function's) are the score's too
        if (turn_sums := add_turn_rewards(seqs, turns, ends, f"reward function '{cfg.reward.function}'")) is not None:
            scores = scores + turn_sums.float()
        if a.overlong.enabled:
            lengths = seqs.response_mask.sum(-1).cpu()  # (scores are on the CPU until advantages_of)
            scores = scores + algos.overlong_penalty(
                lengths, cfg.rollout.max_new_tokens, a.overlong.buffer_len, a.overlong.penalty_factor
            )
        self.rollout.scored(step, scores)
        return seqs, scores

    def _fill(self, parts, part_scores, filler, kept: int, want: int) -> tuple[Sequences, torch.Tensor]:
        """Too few informative groups after the last round: top up with tied ones (zero advantage, no
        gradient), so every step trains on a full batch and gradient accumulation stays aligned. Then
        one batch of exactly ``want`` groups."""
        G = self.cfg.algorithm.group_size
        for seqs_tied, scores_tied in filler:
            if kept >= want:
                break
            parts.append(seqs_tied)
            part_scores.append(scores_tied)
            kept += len(seqs_tied) // G
        seqs = Sequences.concat(parts, self.pad_id).select(slice(0, want * G))
        return seqs, torch.cat(part_scores)[: want * G]

    def drill_token(self, text: str) -> int:
        """The id of the ``degenerate`` drill's token: ``text`` ("!" when empty), which must be one token."""
        tokenizer = self.tokenizer if self.tokenizer is not None else self.rollout.tokenizer
        text = text or "!"
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) != 1:
            raise ConfigError(
                f"fault drill degenerate (RLCTL_FAULTS or 'faults'): {text!r} is {len(ids)} tokens for this tokenizer, "
                "not one; name a single token (degenerate@STEP=TOKEN)"
            )
        return ids[0]

    def draw_prompts(self) -> tuple[list[tuple[int, int]], list[str], dict[str, list]]:
        """Each drawn prompt repeated group_size times, with (prompt index, sample index) keys and the
        dataset's other columns aligned for the reward function."""
        g, key = self.cfg.algorithm.group_size, self.cfg.data.prompt_key
        rows = self.data.next_batch(self.cfg.trainer.prompts_per_step)
        self.drawn = [idx for idx, _ in rows]  # every rank draws the whole batch and keeps its share
        rows = rows[self.dist.shard(len(rows))]
        keys = [(idx, s) for idx, _ in rows for s in range(g)]
        expanded = [row for _, row in rows for _ in range(g)]
        columns = columns_of(expanded, key)
        return keys, [r[key] for r in expanded], columns

    def score(
        self, prompts: list[str], completions: list[str], columns: dict[str, list], turns: list | None = None
    ) -> torch.Tensor:
        """(B,) float32 scores from the reward function, called as untrusted code: an InputError names
        it, and the value and completion index, for anything but one finite number per completion (or,
        with ``turns``, a multi-turn rollout's, a score and its turns' rewards: ``check_scores``)."""
        reward = self.cfg.reward
        scores = score_completions(self.reward_fn, reward.function, prompts, completions, columns, reward.kwargs, turns)
        return torch.as_tensor(scores, dtype=torch.float32)


def repeated_token(seqs: Sequences, token: int, length: int) -> Sequences:
    """The ``degenerate`` fault drill: every response of ``seqs`` replaced by ``token`` repeated
    ``length`` times (the response budget, no eos), as a collapsed policy writes ``!!!!!!!!``. The
    rollout engine's log-probs are dropped (None): it never sampled these tokens, so the old
    log-probs come from the actor's own forward on them (and rollout/logprob_diff is not reported for
    the step)."""
    B, P = len(seqs), seqs.prompt_len
    prompt_ids, prompt_mask = seqs.input_ids[:, :P], seqs.attention_mask[:, :P]
    responses = torch.full((B, length), token, dtype=prompt_ids.dtype, device=prompt_ids.device)
    mask = torch.ones((B, length), dtype=prompt_mask.dtype, device=prompt_mask.device)
    return Sequences(torch.cat([prompt_ids, responses], 1), torch.cat([prompt_mask, mask], 1), mask, P, None)


def batch_metrics(
    seqs: Sequences,
    scores: torch.Tensor,
    rewards: torch.Tensor,
    adv: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor | None,
    old: torch.Tensor | None,
    ref: torch.Tensor | None,
    max_new_tokens: int,
) -> dict[str, float]:
    """verl's batch metrics, and the degeneration signals of the responses (``signals``). (B,) scores;
    (B, T) token rewards, advantages, returns, values."""
    mask = seqs.response_mask
    lengths = mask.sum(-1).float()
    prompt_lengths = seqs.attention_mask[:, : seqs.prompt_len].sum(-1).float()
    real = mask.bool()
    out = {
        "critic/score/mean": scores.mean().item(),
        "critic/score/max": scores.max().item(),
        "critic/score/min": scores.min().item(),
        "critic/rewards/mean": rewards.sum(-1).mean().item(),
        "critic/advantages/mean": algos.masked_mean(adv, mask).item(),
        "critic/advantages/max": adv[real].max().item() if real.any() else 0.0,
        "critic/advantages/min": adv[real].min().item() if real.any() else 0.0,
        "critic/returns/mean": algos.masked_mean(returns, mask).item(),
        "response_length/mean": lengths.mean().item(),
        "response_length/max": lengths.max().item(),
        "response_length/min": lengths.min().item(),
        "response_length/clip_ratio": (lengths >= max_new_tokens).float().mean().item(),
        "prompt_length/mean": prompt_lengths.mean().item(),
        "actor/nonfinite/ref_log_prob": 0.0 if ref is None else algos.count_nonfinite(ref, mask),
        **degeneration_metrics(seqs.responses, mask),
    }
    if values is not None:
        out["critic/values/mean"] = algos.masked_mean(values, mask).item()
    if old is not None:  # else the update counted them on its own forward
        out["actor/nonfinite/old_log_prob"] = algos.count_nonfinite(old, mask)
    return out


def advantages_of(a: AlgorithmConfig, seqs: Sequences, scores: torch.Tensor, old, ref, values, kl_coef: float):
    """Under the algorithm config ``a``: (B, T) token rewards (the score on the last token, less the KL
    penalty when it is folded into the reward), the KL measured then (else None), (B, T) advantages and
    returns. (B, T) ``old`` and ``ref`` log-probs and ``values`` may be None where unused. The part of a
    score that an environment gave single turns (``seqs.turn_rewards``) is on the ends of those turns
    instead: the outcome estimators sum the same, GAE and REINFORCE++ see where it was earned."""
    mask = seqs.response_mask
    scores = scores.to(mask.device)  # (the reward function's, on the CPU until here)
    rewards = algos.scores_to_token_rewards(scores, mask)
    if seqs.turn_rewards is not None:  # part of the scores: moved from the last token to their turns' ends
        turns = seqs.turn_rewards.to(mask.device, rewards.dtype) * mask
        rewards = algos.scores_to_token_rewards(scores - turns.sum(-1), mask) + turns
    current_kl = None
    if a.kl_in_reward and ref is not None:
        rewards, current_kl = algos.apply_kl_penalty(rewards, old, ref, mask, kl_coef, a.kl_estimator)
    inputs = algos.AdvantageInputs(
        token_rewards=rewards,
        mask=mask,
        group_size=a.group_size,
        values=values,
        gamma=a.gamma,
        lam=a.lam,
        eps=a.adv_eps,
    )
    advantages, returns = algos.ADVANTAGES[a.estimator](inputs)
    return rewards, current_kl, advantages, returns
