"""Multi-turn rollouts with tool calls on the HF backend, token in and token out.

Every conversation starts from its prompt (the chat template with the tools' schemas). Each turn, the
live conversations generate from their ids so far (``hf.decode``; seeds from (seed, step, prompt,
sample, turn)), ended by eos, the end of a call (the format's end string, with one call per turn), or
the budget: ``rollout.max_new_tokens`` of the model's tokens over all turns, ``max_total_tokens``
after the prompt. A turn's calls are parsed (``rlctl.tools.formats``), checked against the tools'
schemas and run in the rank's worker processes (``engine.tools.pool``); their answers, cut to
``max_tool_response_tokens``, are appended as the ids the template adds for them (``chat``), after the
template's close of the model's turn. A conversation ends on a turn without a call, at ``max_turns``,
or when the budget is spent.

The batch: the response is everything after the prompt, attended to; ``response_mask`` is 1 on the
model's own tokens only, so the tools' tokens and the template's boundary tokens take no part in the
policy loss, the KL, the entropy, their normalisation or the response length (overlong penalties count
the model's tokens). Rollout log-probs are the model's tokens' (0 elsewhere). A conversation that met
an infrastructure failure (a timeout, ``ToolUnavailable``, a dead worker) is masked whole: no mistake
of the model's is trained on. At its end each conversation is rendered whole and compared with its ids
(``chat.first_drift``): ``multi_turn/template_drift_frac`` and a ``template_drift`` event. The
``tool_outage`` fault drill (``rlctl.faults``) answers every call of its steps as unavailable, the
tools never asked.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from rlctl import events as names
from rlctl import faults
from rlctl.config import RunConfig
from rlctl.config.multi_turn import MultiTurnConfig
from rlctl.engine.batch import Sequences
from rlctl.engine.data import prompt_messages
from rlctl.engine.dist import MAX, MEAN, SUM
from rlctl.engine.rollout.chat import first_drift, tool_message
from rlctl.engine.rollout.hf import HFRollout, SeededGumbelSampler, decode, response_mask_for
from rlctl.engine.rollout.offers import EVERY_TOOL, Offer, Offers
from rlctl.engine.rollout.sampling import StopStrings
from rlctl.engine.rollout.seeds import sample_seed
from rlctl.engine.rollout.transcript import TranscriptLog, segments
from rlctl.engine.tools.loader import Tools
from rlctl.engine.tools.pool import ERROR, INFRA, OK, TIMEOUT, UNAVAILABLE, CallResult, ToolPool
from rlctl.engine.tools.record import ToolRecord, call_key
from rlctl.tools.formats import FORMATS
from rlctl.tools.schema import check_call

# How the ranks reduce the metrics of a step's conversations (tool/<name>/calls: SUM, ``reductions``).
MULTI_TURN_METRICS = {
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
OUTAGE = "the tool is unavailable (fault drill tool_outage)"  # what a call under the drill is answered


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

    @property
    def model_tokens(self) -> int:
        return sum(self.model)


@dataclass
class ToolStats:
    calls: int = 0  # attempts: well-formed or not
    errors: int = 0
    invalid: int = 0
    timeouts: int = 0
    unavailable: int = 0
    replayed: int = 0  # answers read from the run's record (a step run again), not asked of the tool
    seconds: float = 0.0
    by_name: dict[str, int] = field(default_factory=dict)


class MultiTurnRollout(HFRollout):
    def __init__(
        self,
        cfg: RunConfig,
        actor,
        tokenizer,
        mt: MultiTurnConfig,
        tools: Tools,
        pool: ToolPool,
        emit=None,
        record: ToolRecord | None = None,
        transcripts: TranscriptLog | None = None,
    ):
        """``mt``: the multi-turn settings; ``tools``: their schemas and functions by name
        (``engine.tools.loader``); ``pool``: the rank's tool workers (its owner closes it); ``emit``
        receives the ``template_drift`` and ``tool_calls_replayed`` events; ``record``: the run's record
        of tool calls (``engine.tools.record``; None: nothing recorded or replayed); ``transcripts``: where
        the conversations of each training step are written (``transcript``; None: nowhere)."""
        super().__init__(cfg, actor, tokenizer)
        schemas, functions = tools.schemas, tools.functions
        self.mt, self.schemas, self.functions = mt, schemas, functions
        self.format = FORMATS[mt.format]
        self.offers = Offers(mt, tools, tokenizer, cfg.model.path or "the built-in model")
        self.chat = self.offers.chat(EVERY_TOOL)
        stops = [*cfg.rollout.stop, self.format.end] if mt.max_parallel_calls == 1 else list(cfg.rollout.stop)
        self.turn_stops = StopStrings(tokenizer, stops)
        self.pool, self.record, self.transcripts = pool, record, transcripts
        self._last: list[Conversation] = []  # the last generate's conversations, for ``scored``
        self.emit: Callable[[dict[str, Any]], None] = emit or (lambda event: None)
        self.reductions = {**MULTI_TURN_METRICS, **{f"tool/{name}/calls": SUM for name in schemas}}
        self._metrics: list[dict[str, float]] = []
        self._outage: bool | None = None  # the tool_outage drill's answer for the step running (None: not asked)

    def decode(self, seqs: Sequences) -> list[str]:
        """The text of each conversation's last turn of the model (its last run of trained tokens, eos
        left out): the answer a reward function scores. A conversation masked whole gives ""."""
        texts = []
        for ids, mask in zip(seqs.responses.cpu().tolist(), seqs.response_mask.cpu().tolist()):
            end = max((i + 1 for i, m in enumerate(mask) if m), default=0)
            start = end
            while start > 0 and mask[start - 1]:
                start -= 1
            last = [x for x in ids[start:end] if x not in self.eos_ids]
            texts.append(self.tokenizer.decode(last, skip_special_tokens=False))
        return texts

    def take_metrics(self) -> dict[str, float]:
        """The metrics of the conversations generated since the last call (every round of a step), as
        one row (``reductions``). The step's run is over: the next generate asks the drills again."""
        rows, self._metrics, self._outage = self._metrics, [], None
        if self.transcripts is not None:
            self.transcripts.write()
        if not rows:
            return {}
        weights = [r.pop("_n") for r in rows]
        out = {}
        for key, how in self.reductions.items():
            values = [r[key] for r in rows]
            if how == MEAN:
                out[key] = sum(v * w for v, w in zip(values, weights)) / sum(weights)
            else:
                out[key] = max(values) if how == MAX else sum(values)
        return out

    @torch.no_grad()
    def generate(
        self,
        prompts: list[str],
        keys: list[tuple[int, int]],
        step: int,
        temperature: float | None = None,
        columns: dict[str, list] | None = None,
    ) -> Sequences:
        """``columns``: the prompts' rows, which may choose each one's tools and hidden arguments (``offers``)."""
        offers = self.offers.of(columns, keys)
        enc = self.encode(prompts, offers)
        convs = [
            Conversation(p, k, messages=prompt_messages(self.cfg.data, p), offer=o)
            for p, k, o in zip(prompts, keys, offers)
        ]
        prompt_ids = [ids[m.bool()].tolist() for ids, m in zip(enc["input_ids"].cpu(), enc["attention_mask"].cpu())]
        t = self.cfg.rollout.temperature if temperature is None else temperature
        stats = ToolStats(by_name=dict.fromkeys(self.schemas, 0))
        if self.record is not None:
            self.record.begin(step)
        if self._outage is None:  # once per run of a step, every round of it alike
            self._outage = faults.tool_outage(step)
        module = self.actor.module
        was_training = module.training
        module.eval()
        try:  # gathered once for all the turns (ZeRO-3): ranks may take different numbers of turns
            with self.actor.full_parameters():
                for turn in range(self.mt.max_turns):
                    live = [i for i, c in enumerate(convs) if not c.done]
                    if not live:
                        break
                    turns = self._generate_turn([prompt_ids[i] for i in live], [convs[i] for i in live], step, turn, t)
                    self._answer([convs[i] for i in live], turns, step, turn, stats)
        finally:
            module.train(was_training)
        self._metrics.append(self._row(convs, stats, step))
        if stats.replayed:
            self.emit({"event": names.TOOL_CALLS_REPLAYED, "step": step, "calls": stats.replayed})
        self._last = convs
        return self._batch(enc, convs)

    def reward_columns(self) -> dict[str, list[Any]]:
        """What the reward function gets of the last generated conversations besides the completion (the
        text of the model's last turn): ``conversation``, each one's messages (the prompt's, then the
        model's turns and the tools' answers, in order), and ``tool_calls``, each one's calls (turn,
        name, arguments, outcome, the answer as the model saw it)."""
        return {"conversation": [c.messages for c in self._last], "tool_calls": [c.calls for c in self._last]}

    def scored(self, step: int, scores: torch.Tensor) -> None:
        """The scores of the last generated conversations (a round of a training step): their
        transcripts join the step's (``transcripts``; written by ``take_metrics``)."""
        if self.transcripts is None:
            return
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731
        for c, score in zip(self._last, scores.tolist()):
            self.transcripts.add(
                step,
                {
                    "prompt_index": c.seed[0],
                    "sample_index": c.seed[1],
                    "score": score,
                    "masked": c.infra_failed,
                    "turns": c.turns,
                    "drift_at": c.drift_at,
                    "prompt": c.prompt,
                    "calls": c.calls,
                    "segments": segments(c.ids, c.model, not c.infra_failed, decode),
                },
            )

    def encode(self, prompts: list[str], offers: list[Offer] | None = None) -> dict[str, torch.Tensor]:
        """As the HF backend, with the schemas of the tools offered to each prompt given to the chat template."""
        tok = self.tokenizer
        tok.truncation_side = "left"
        offers = offers or [EVERY_TOOL] * len(prompts)
        texts = [
            self.offers.chat(o).render(prompt_messages(self.cfg.data, p), generation_prompt=True)
            for p, o in zip(prompts, offers)
        ]
        enc = tok(
            texts,
            return_tensors="pt",
            padding=True,
            truncation=True,
            max_length=self.cfg.data.max_prompt_length,
            add_special_tokens=False,
        )
        return {k: v.to(self.actor.runtime.device) for k, v in enc.items() if k in ("input_ids", "attention_mask")}

    def _generate_turn(self, prompts: list[list[int]], convs: list[Conversation], step, turn, t) -> list[list[int]]:
        """One turn of the live conversations: each one's new model tokens (appended, with log-probs)."""
        r = self.cfg.rollout
        budgets = [min(r.max_new_tokens - c.model_tokens, self.mt.max_total_tokens - len(c.ids)) for c in convs]
        rows = [p + c.ids for p, c in zip(prompts, convs)]
        width = max(map(len, rows))
        pad = self.tokenizer.pad_token_id
        ids = torch.tensor([[pad] * (width - len(x)) + x for x in rows], device=self.actor.runtime.device)
        attn = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in rows], device=ids.device)
        seeds = [sample_seed(self.cfg.seed, step, *c.seed, turn=turn) for c in convs]
        sampler = SeededGumbelSampler(seeds, t, top_p=r.top_p, top_k=r.top_k, min_p=r.min_p)
        module = self.actor.module  # in eval mode, its parameters gathered (``generate``)
        out, lps, kept = decode(module, ids, attn, max(budgets), self.eos_ids, pad, sampler, self.turn_stops)
        mask = response_mask_for(out, self.eos_ids, kept if self.turn_stops else None)
        new = []
        for k, (c, budget) in enumerate(zip(convs, budgets)):
            n = min(int(mask[k].sum()), budget)
            tokens = out[k, :n].tolist()
            c.ids += tokens
            c.model += [True] * n
            c.log_probs += lps[k, :n].tolist()
            c.turns += 1
            new.append(tokens)
        return new

    def _answer(
        self, convs: list[Conversation], turns: list[list[int]], step: int, turn: int, stats: ToolStats
    ) -> None:
        """Parse each conversation's new turn, run its calls (all conversations' together) and append the
        answers; end the conversations that made no call, ran out of turns or of budget."""
        jobs, plans = [], []
        for c, tokens in zip(convs, turns):
            text = self.tokenizer.decode([x for x in tokens if x not in self.eos_ids], skip_special_tokens=False)
            c.messages.append({"role": "assistant", "content": text})
            parsed = self.format.parse(text)
            stats.calls += parsed.attempts
            stats.invalid += len(parsed.invalid)
            if parsed.attempts == 0 or self._spent(c):
                c.done = True
                continue
            if turn == self.mt.max_turns - 1:
                c.done = c.max_turns_reached = True
                continue
            answers: list[tuple[str, str] | int] = []
            for call in parsed.calls:
                args, problem = check_call(call, self.offers.schemas(c.offer))
                if problem is None and sum(isinstance(a, int) for a in answers) >= self.mt.max_parallel_calls:
                    problem = f"at most {self.mt.max_parallel_calls} tool calls run per turn"
                if problem is not None:
                    stats.invalid += 1
                    answers.append((call.name, f"error: {problem}"))
                    continue
                stats.by_name[call.name] += 1
                answers.append(len(jobs))
                args = {**args, **c.offer.hidden.get(call.name, {})}  # the row's hidden values, never shown
                key = call_key(step, c.prompt, c.seed, turn, len(answers) - 1, call.name, args)
                jobs.append((self.functions[call.name], args, call.name, key))
            answers += [("invalid", f"error: {sentence}") for sentence in parsed.invalid]
            plans.append((c, tokens, answers))
        results = self._run(jobs, stats)
        for c, tokens, answers in plans:
            messages = []
            for a in answers:
                if isinstance(a, int):
                    res, name = results[a], jobs[a][2]
                    stats.errors += res.outcome == ERROR
                    stats.timeouts += res.outcome == TIMEOUT
                    stats.unavailable += res.outcome == UNAVAILABLE
                    c.infra_failed |= res.outcome in INFRA
                    content = res.text if res.outcome == OK else f"error: {res.text}"
                    messages.append((name, self._cut(content)))
                    c.calls.append({"turn": turn, "name": name, "arguments": jobs[a][1], "outcome": res.outcome})
                else:
                    messages.append((a[0], self._cut(a[1])))
                    c.calls.append({"turn": turn, "name": a[0], "arguments": None, "outcome": "invalid"})
                c.calls[-1]["answer"] = messages[-1][1]
            self._append_answers(c, tokens, messages)

    def _run(self, jobs: list[tuple[str, dict[str, Any], str, str]], stats: ToolStats) -> list[CallResult]:
        """The answers of a turn's calls: recorded ones replayed (``record``), the others run in the pool
        together and recorded. Under the ``tool_outage`` drill every call is unavailable, nothing asked
        or replayed (an infrastructure failure is never recorded)."""
        if self._outage:
            return [CallResult(UNAVAILABLE, OUTAGE, 0.0) for _ in jobs]
        results: list[CallResult | None] = [None] * len(jobs)
        fresh = []
        for i, (_, _, _, key) in enumerate(jobs):
            old = self.record.replay(key) if self.record is not None else None
            if old is None:
                fresh.append(i)
            else:
                results[i] = CallResult(old.outcome, old.text, old.seconds)
                stats.replayed += 1

        def recorded(j: int, res: CallResult) -> None:  # on storage as each call ends
            if self.record is not None and res.outcome not in INFRA:
                self.record.add(jobs[fresh[j]][3], res.outcome, res.text, res.seconds)
                self.record.flush()

        t0 = time.perf_counter()
        answered = self.pool.run([(jobs[i][0], jobs[i][1]) for i in fresh], recorded) if fresh else []
        stats.seconds += time.perf_counter() - t0
        for i, res in zip(fresh, answered):
            results[i] = res
        return results  # type: ignore[return-value]

    def _append_answers(self, c: Conversation, tokens: list[int], messages: list[tuple[str, str]]) -> None:
        chat = self.offers.chat(c.offer)
        env = chat.closing(tokens) + chat.tool_ids(messages)
        if len(c.ids) + len(env) >= self.mt.max_total_tokens:
            c.done = True  # no room for the answers and a turn after them
            return
        c.ids += env
        c.model += [False] * len(env)
        c.log_probs += [0.0] * len(env)
        c.messages += [tool_message(n, content) for n, content in messages]

    def _spent(self, c: Conversation) -> bool:
        return c.model_tokens >= self.cfg.rollout.max_new_tokens or len(c.ids) >= self.mt.max_total_tokens

    def _cut(self, text: str) -> str:
        """``text`` cut to ``max_tool_response_tokens`` tokens."""
        ids = self.chat.encode(text)
        limit = self.mt.max_tool_response_tokens
        return text if len(ids) <= limit else self.tokenizer.decode(ids[:limit], skip_special_tokens=False)

    def _batch(self, enc: dict[str, torch.Tensor], convs: list[Conversation]) -> Sequences:
        """The prompts as encoded, each conversation's ids after them (right-padded); the mask on the
        model's tokens of conversations without an infrastructure failure."""
        T = max(1, max(len(c.ids) for c in convs))
        pad, device = self.tokenizer.pad_token_id, enc["input_ids"].device
        resp = torch.full((len(convs), T), pad, dtype=enc["input_ids"].dtype)
        attn, mask = torch.zeros(len(convs), T, dtype=torch.long), torch.zeros(len(convs), T, dtype=torch.long)
        lps = torch.zeros(len(convs), T)
        for i, c in enumerate(convs):
            n = len(c.ids)
            resp[i, :n] = torch.tensor(c.ids, dtype=resp.dtype)
            attn[i, :n] = 1
            if not c.infra_failed:
                mask[i, :n] = torch.tensor(c.model, dtype=torch.long)
            lps[i, :n] = torch.tensor(c.log_probs) * mask[i, :n]
        input_ids = torch.cat([enc["input_ids"], resp.to(device)], dim=1)
        attention = torch.cat([enc["attention_mask"], attn.to(device)], dim=1)
        return Sequences(input_ids, attention, mask.to(device), enc["input_ids"].shape[1], lps.to(device))

    def _row(self, convs: list[Conversation], stats: ToolStats, step: int) -> dict[str, float]:
        """The metrics of one generate call; drifting conversations reported as events."""
        drifted = 0
        for c in convs:
            at = c.drift_at = self.drift(c)
            if at is not None:
                drifted += 1
                self.emit(
                    {
                        "event": names.TEMPLATE_DRIFT,
                        "step": step,
                        "prompt_index": c.seed[0],
                        "sample_index": c.seed[1],
                        "position": at,
                        "tokens": len(c.ids),
                    }
                )
        n, calls = len(convs), max(stats.calls, 1)
        tokens = sum(len(c.ids) for c in convs)
        return {
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
        }

    def drift(self, c: Conversation) -> int | None:
        """The first position after the prompt where the conversation's ids differ from its whole
        rendering (None: none). Before the prompt's end they must agree too (a negative position)."""
        chat = self.offers.chat(c.offer)
        prompt = chat.encode(chat.render(c.messages[: len(prompt_messages(self.cfg.data, c.prompt))], True))
        full = chat.encode(chat.render(c.messages))
        at = first_drift(prompt + c.ids, full)
        return None if at is None else at - len(prompt)
