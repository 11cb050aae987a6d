"""The rollout batch that generation produces and the actor and the critic train on."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Sequences:
    """A rollout batch. P prompt tokens (left-padded), T response tokens (right-padded)."""

    input_ids: torch.Tensor  # (B, P+T) prompt then response token ids
    attention_mask: torch.Tensor  # (B, P+T) 1 on real prompt tokens and real response tokens
    response_mask: torch.Tensor  # (B, T) 1 on response tokens up to and including the first eos
    prompt_len: int  # P
    # (B, T) fp32 log-probs of the sampled tokens as the rollout engine computed them (0 past the
    # response), or None: compared with the actor's for `rollout/logprob_diff`
    rollout_log_probs: torch.Tensor | None = None
    # (B, T) rewards of single turns of a multi-turn conversation (an environment's), each on its turn's
    # last token of the model's, or None. Part of the completion's score already: they only say where in
    # the response that part of it was earned (``experience.advantages_of``).
    turn_rewards: torch.Tensor | None = None

    @property
    def responses(self) -> torch.Tensor:  # (B, T)
        return self.input_ids[:, self.prompt_len :]

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def select(self, idx) -> Sequences:
        lp = None if self.rollout_log_probs is None else self.rollout_log_probs[idx]
        tr = None if self.turn_rewards is None else self.turn_rewards[idx]
        return Sequences(
            self.input_ids[idx], self.attention_mask[idx], self.response_mask[idx], self.prompt_len, lp, tr
        )

    @staticmethod
    def concat(parts: list[Sequences], pad_id: int) -> Sequences:
        """One batch from several (rounds of dynamic sampling): prompts re-padded on the left, responses
        on the right, to the longest of each."""
        if len(parts) == 1:
            return parts[0]
        P = max(p.prompt_len for p in parts)
        T = max(p.responses.shape[1] for p in parts)
        ids, attn, resp_mask, lps, trs = [], [], [], [], []
        with_lp = all(p.rollout_log_probs is not None for p in parts)
        with_tr = any(p.turn_rewards is not None for p in parts)
        for p in parts:
            left, right = P - p.prompt_len, T - p.responses.shape[1]
            ids.append(torch.nn.functional.pad(p.input_ids, (left, right), value=pad_id))
            attn.append(torch.nn.functional.pad(p.attention_mask, (left, right), value=0))
            resp_mask.append(torch.nn.functional.pad(p.response_mask, (0, right), value=0))
            if with_lp:
                lps.append(torch.nn.functional.pad(p.rollout_log_probs, (0, right), value=0.0))
            if with_tr:
                tr = (
                    p.turn_rewards
                    if p.turn_rewards is not None
                    else torch.zeros_like(p.response_mask, dtype=torch.float)
                )
                trs.append(torch.nn.functional.pad(tr, (0, right), value=0.0))
        return Sequences(
            torch.cat(ids),
            torch.cat(attn),
            torch.cat(resp_mask),
            P,
            torch.cat(lps) if with_lp else None,
            torch.cat(trs) if with_tr else None,
        )


def position_ids_for(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions count real tokens only, as transformers' generate does for left-padded prompts."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
