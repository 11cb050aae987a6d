"""Multi-turn rollouts whose turns vLLM samples (``rollout.backend: vllm`` with ``rollout.multi_turn``).

The conversation loop is ``MultiTurnRollout``'s: tools, environments, masks, the record and the drift
check are the same on both backends. Each turn, the rank's vLLM engine (``VLLMRollout``) continues every
live conversation from its ids so far (prompt, the model's earlier turns, the tools' answers: token in,
token out), each with its own seed ``sample_seed(seed, step, prompt, sample, turn)`` and the turn's
budget. vLLM runs without a tokenizer here, so the end of a tool call (a stop string) is found by rlctl
after generation, as for single turns: the engine samples such a turn on to its eos or budget and the
tokens after the call's end are dropped. The engine's prefix cache serves a conversation's earlier turns
again. Weights are the engine's: ``sync_weights`` pushes the actor's after every update, so nothing is
gathered for a generate.
"""

from __future__ import annotations

import contextlib

import torch

from rlctl.engine.batch import Sequences
from rlctl.engine.rollout.conversation import Conversation
from rlctl.engine.rollout.multi_turn import MultiTurnRollout
from rlctl.engine.rollout.seeds import sample_seed
from rlctl.engine.rollout.vllm import VLLMRollout, process_state_kept


class VLLMMultiTurnRollout(MultiTurnRollout):
    def __init__(self, engine: VLLMRollout, *args, **kwargs):
        """``engine``: the rank's vLLM rollout (its owner's ``close`` shuts it down); the rest as for
        ``MultiTurnRollout``."""
        super().__init__(*args, **kwargs)
        self.engine = engine

    def sync_weights(self) -> None:
        self.engine.sync_weights()

    def forget_cache(self) -> None:
        self.engine.forget_cache()

    def close(self) -> None:
        self.engine.close()

    def weights_for_turns(self):
        return contextlib.nullcontext()  # the engine holds its own copy of the weights

    def generate(self, prompts, keys, step, temperature=None, columns=None) -> Sequences:
        """As ``MultiTurnRollout``; the rollout's log-probs are dropped where vLLM's are not of the
        untruncated softmax(logits / T) (a top_p/top_k/min_p filter at a temperature other than 0 and 1)."""
        seqs = super().generate(prompts, keys, step, temperature=temperature, columns=columns)
        t = self.cfg.rollout.temperature if temperature is None else temperature
        if self.cfg.rollout.truncates() and t not in (0.0, 1.0):
            seqs.rollout_log_probs = None
        return seqs

    def _generate_turn(self, prompts: list[list[int]], convs: list[Conversation], step, turn, t) -> list[list[int]]:
        """One turn of the live conversations, sampled by the engine: each one's new model tokens (appended,
        with their log-probs)."""
        r = self.cfg.rollout
        budgets = [min(r.max_new_tokens - c.model_tokens, self.mt.max_total_tokens - len(c.ids)) for c in convs]
        requests = [{"prompt_token_ids": p + c.ids} for p, c in zip(prompts, convs)]
        params = [
            self.engine.vllm.SamplingParams(
                max_tokens=max(1, budget),
                temperature=t,
                top_p=r.top_p,
                top_k=max(r.top_k, 0),
                min_p=r.min_p,
                seed=sample_seed(self.cfg.seed, step, *c.seed, turn=turn),
                stop_token_ids=self.eos_ids,
                logprobs=0,
                detokenize=False,
            )
            for c, budget in zip(convs, budgets)
        ]
        with process_state_kept(self.engine.cpu), torch.no_grad():
            outputs = self.engine.llm.generate(requests, params, use_tqdm=False)
        new = []
        for c, out, budget in zip(convs, outputs, budgets):
            sampled = out.outputs[0]
            n = min(self.turn_stops.length(list(sampled.token_ids), self.eos_ids), budget)
            tokens = list(sampled.token_ids[:n])
            c.add_turn(tokens, [lp[x].logprob for x, lp in zip(tokens, sampled.logprobs)])
            new.append(tokens)
        return new
