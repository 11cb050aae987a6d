"""Multi-turn rollouts with tool calls on the HF backend, token in and token out.

Every conversation starts from its prompt (the chat template with the tools' schemas). Each turn, the
live conversations generate from their ids so far (``hf.decode``; seeds from (seed, step, prompt,
sample, turn)), ended by eos, the end of a call (the format's end string, with one call per turn), or
the budget: ``rollout.max_new_tokens`` of the model's tokens over all turns, ``max_total_tokens``
after the prompt. A turn's calls are parsed (``rlctl.tools.formats``), checked against the tools'
schemas and run in the rank's worker processes (``engine.tool_workers.pool``); their answers, cut to
``max_tool_response_tokens``, are appended as the ids the template adds for them (``chat``), after the
template's close of the model's turn. A conversation ends on a turn without a call, at ``max_turns``,
or when the budget is spent.

The batch: the response is everything after the prompt, attended to; ``response_mask`` is 1 on the
model's own tokens only, so the tools' tokens and the template's boundary tokens take no part in the
policy loss, the KL, the entropy, their normalisation or the response length (overlong penalties count
the model's tokens). Rollout log-probs are the model's tokens' (0 elsewhere). A conversation that met
an infrastructure failure (a timeout, ``ToolUnavailable``, a dead worker) is masked whole: no mistake
of the model's is trained on. At its end each conversation is rendered whole and compared with its ids
(``chat.first_drift``): ``multi_turn/template_drift_frac`` and a ``template_drift`` event.

The calls, once checked, are run, replayed and recorded by ``tool_calls`` (stateful tools and
environments included: objects kept per conversation in the tool workers). With an environment, every
turn of the model's is its action: ``step`` answers the next user message, a reward on the turn's last
token (``Conversation.turn_rewards``, part of the score) and whether the conversation is done.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import torch

from rlctl import events as names
from rlctl.config import RunConfig
from rlctl.config.multi_turn import MultiTurnConfig
from rlctl.engine.batch import Sequences
from rlctl.engine.data import prompt_messages
from rlctl.engine.dist import MAX, MEAN, SUM
from rlctl.engine.rollout.chat import first_drift, tool_message
from rlctl.engine.rollout.conversation import (
    ENVIRONMENT_REDUCTIONS,
    MULTI_TURN_REDUCTIONS,
    Conversation,
    ToolStats,
    batch_of,
    metrics_row,
)
from rlctl.engine.rollout.hf import HFRollout, decode, response_mask_for, sampler_for
from rlctl.engine.rollout.offers import EVERY_TOOL, Offer, Offers
from rlctl.engine.rollout.sampling import StopStrings
from rlctl.engine.rollout.seeds import sample_seed
from rlctl.engine.rollout.tool_calls import ENVIRONMENT, Job, ToolCalls
from rlctl.engine.rollout.trajectory import TrajectoryLog, segments
from rlctl.engine.tool_workers.call_record import ToolRecord
from rlctl.engine.tool_workers.loader import Tools
from rlctl.engine.tool_workers.pool import INFRA, OK, ToolPool
from rlctl.tools.formats import FORMATS
from rlctl.tools.schema import check_call


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
        trajectories: TrajectoryLog | None = None,
    ):
        """``mt``: the multi-turn settings; ``tools``: their schemas and functions by name
        (``engine.tool_workers.loader``); ``pool``: the rank's tool workers (its owner closes it); ``emit``
        receives the ``template_drift`` and ``tool_calls_replayed`` events; ``record``: the run's record
        of tool calls (``engine.tool_workers.call_record``; None: nothing recorded or replayed); ``trajectories``: where
        the conversations of each training step are written (``trajectory``; None: nowhere)."""
        super().__init__(cfg, actor, tokenizer)
        self.mt, self.schemas, self.environment = mt, tools.schemas, tools.environment
        self.calls = ToolCalls(tools, pool, record)
        self.format = FORMATS[mt.format]
        self.offers = Offers(mt, tools, tokenizer, cfg.model.path or "the built-in model")
        self.chat = self.offers.chat(EVERY_TOOL)
        stops = [*cfg.rollout.stop, self.format.end] if mt.max_parallel_calls == 1 else list(cfg.rollout.stop)
        self.turn_stops = StopStrings(tokenizer, stops)
        self.trajectories = trajectories
        self._last: list[Conversation] = []  # the last generate's conversations, for ``scored``
        self.emit: Callable[[dict[str, Any]], None] = emit or (lambda event: None)
        self.call_metrics = tools.call_metrics  # name -> a tool's own metrics of a call (tool/python/*)
        own = {key: how for hook in self.call_metrics.values() for key, how in hook.reductions.items()}
        self.reductions = {**MULTI_TURN_REDUCTIONS, **{f"tool/{name}/calls": SUM for name in self.schemas}, **own}
        if self.environment is not None:
            self.reductions.update(ENVIRONMENT_REDUCTIONS)
        self._metrics: list[dict[str, float]] = []

    @property
    def record(self) -> ToolRecord | None:
        """The run's record of tool calls (``tool_calls``)."""
        return self.calls.record

    @record.setter
    def record(self, record: ToolRecord | None) -> None:
        self.calls.record = record

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
        rows, self._metrics = self._metrics, []
        self.calls.step_over()
        if self.trajectories is not None:
            self.trajectories.write()
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
            Conversation(p, k, messages=prompt_messages(self.cfg.data, p), offer=o, env_args=e)
            for p, k, o, e in zip(prompts, keys, offers, self.offers.env_args(columns, keys))
        ]
        prompt_ids = [ids[m.bool()].tolist() for ids, m in zip(enc["input_ids"].cpu(), enc["attention_mask"].cpu())]
        t = self.cfg.rollout.temperature if temperature is None else temperature
        own = {key: 0.0 for hook in self.call_metrics.values() for key in hook.reductions}
        stats = ToolStats(by_name=dict.fromkeys(self.schemas, 0), own=own)
        self.calls.begin(step)
        module = self.actor.module
        was_training = module.training
        module.eval()
        try:  # gathered once for all the turns (ZeRO-3): ranks may take different numbers of turns
            with self.weights_for_turns():
                for turn in range(self.mt.max_turns):
                    live = [i for i, c in enumerate(convs) if not c.done]
                    if not live:
                        break
                    turns = self._generate_turn([prompt_ids[i] for i in live], [convs[i] for i in live], step, turn, t)
                    answer = self._step_environment if self.environment is not None else self._answer
                    answer([(i, convs[i]) for i in live], turns, step, turn, stats)
        finally:
            module.train(was_training)
            self.calls.release()
        self._metrics.append(self._row(convs, stats, step))
        if stats.replayed:
            self.emit({"event": names.TOOL_CALLS_REPLAYED, "step": step, "calls": stats.replayed})
        self._last = convs
        return batch_of(enc, convs, self.tokenizer.pad_token_id)

    def weights_for_turns(self):
        """What every turn of a generate samples under: the actor's parameters gathered once (ZeRO-3)."""
        return self.actor.full_parameters()

    def turn_ends(self) -> list[list[int | None]]:
        """Each of the last generated conversations' turns of the model's: its last position after the
        prompt (per-turn rewards sit there)."""
        return [c.turn_ends for c in self._last]

    def reward_columns(self) -> dict[str, list[Any]]:
        """What the reward function gets of the last generated conversations besides the completion (the
        text of the model's last turn): ``conversation``, each one's messages (the prompt's, then the
        model's turns and the tools' answers, in order), and ``tool_calls``, each one's calls (turn,
        name, arguments, outcome, the answer as the model saw it)."""
        return {"conversation": [c.messages for c in self._last], "tool_calls": [c.calls for c in self._last]}

    def scored(self, step: int, scores: torch.Tensor) -> None:
        """The scores of the last generated conversations (a round of a training step): their
        trajectories join the step's (``trajectories``; written by ``take_metrics``)."""
        if self.trajectories is None:
            return
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731
        for c, score in zip(self._last, scores.tolist()):
            self.trajectories.add(
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
        sampler = sampler_for(r, seeds, t)
        module = self.actor.module  # in eval mode, its parameters gathered (``generate``)
        out, lps, kept = decode(
            module, ids, attn, max(budgets), self.eos_ids, pad, sampler, self.turn_stops, cuda_graphs=r.cuda_graphs
        )
        mask = response_mask_for(out, self.eos_ids, kept if self.turn_stops else None)
        new = []
        for k, (c, budget) in enumerate(zip(convs, budgets)):
            n = min(int(mask[k].sum()), budget)
            tokens = out[k, :n].tolist()
            c.add_turn(tokens, lps[k, :n].tolist())
            new.append(tokens)
        return new

    def _answer(
        self, live: list[tuple[int, Conversation]], turns: list[list[int]], step: int, turn: int, stats: ToolStats
    ) -> None:
        """Parse each conversation's new turn, run its calls (all conversations' together) and append the
        answers; end the conversations that made no call, ran out of turns or of budget."""
        jobs: list[Job] = []
        plans = []
        for (index, c), tokens in zip(live, turns):
            text = self._turn_text(tokens)
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
                jobs.append(self.calls.tool_job(index, c, step, turn, len(answers) - 1, call.name, args))
            answers += [("invalid", f"error: {sentence}") for sentence in parsed.invalid]
            plans.append((c, tokens, answers))
        results = self.calls.run(jobs, stats)
        for c, tokens, answers in plans:
            messages = []
            for a in answers:
                if isinstance(a, int):
                    res, job = results[a], jobs[a]
                    self.calls.count(res, stats, job.name)
                    c.infra_failed |= res.outcome in INFRA
                    content = res.text if res.outcome == OK else f"error: {res.text}"
                    messages.append((job.name, self._cut(content)))
                    c.calls.append({"turn": turn, "name": job.name, "arguments": job.shown, "outcome": res.outcome})
                else:
                    messages.append((a[0], self._cut(a[1])))
                    c.calls.append({"turn": turn, "name": a[0], "arguments": None, "outcome": "invalid"})
                c.calls[-1]["answer"] = messages[-1][1]
            if self._append(c, tokens, self.offers.chat(c.offer).tool_ids(messages)):
                c.messages += [tool_message(n, content) for n, content in messages]
            else:  # no room: the model never saw them (a reward reading tool_calls must not count them)
                for call in c.calls[len(c.calls) - len(answers) :]:
                    call["answer"] = None

    def _step_environment(
        self, live: list[tuple[int, Conversation]], turns: list[list[int]], step: int, turn: int, stats: ToolStats
    ) -> None:
        """The environment's step on each conversation's new turn (all conversations' together): its reward
        on the turn's last token of the model's, its observation appended as a user message. A step that
        fails (the environment raised, timed out, is unavailable) masks its conversation and ends it; done,
        no observation, the last turn or the budget spent end it too."""
        jobs = []
        for (index, c), tokens in zip(live, turns):
            text = self._turn_text(tokens)
            c.messages.append({"role": "assistant", "content": text})
            jobs.append(self.calls.environment_job(index, c, step, turn, text))
        stats.calls += len(jobs)
        for (_, c), tokens, job, res in zip(live, turns, jobs, self.calls.run(jobs, stats)):
            self.calls.count(res, stats)
            call = {"turn": turn, "name": ENVIRONMENT, "arguments": job.shown, "outcome": res.outcome}
            c.calls.append(call)
            if res.outcome != OK:
                c.infra_failed = c.done = True  # the environment's failure, not the model's
                call["answer"] = f"error: {res.text}"
                continue
            answer = json.loads(res.text)
            call.update(answer=answer["observation"], reward=answer["reward"], done=answer["done"])
            where = c.last_model_position()
            if where is not None:
                c.turn_rewards.append((where, answer["reward"]))
            if answer["done"] or answer["observation"] is None or self._spent(c):
                c.done = True
            elif turn == self.mt.max_turns - 1:
                c.done = c.max_turns_reached = True
            else:
                observation = self._cut(answer["observation"])
                if self._append(c, tokens, self.chat.user_ids(observation)):
                    call["answer"] = observation
                    c.messages.append({"role": "user", "content": observation})
                else:
                    call["answer"] = None  # no room: the model never saw it

    def _turn_text(self, tokens: list[int]) -> str:
        return self.tokenizer.decode([x for x in tokens if x not in self.eos_ids], skip_special_tokens=False)

    def _append(self, c: Conversation, tokens: list[int], answer: list[int]) -> bool:
        """The template's close of the model's turn and the ``answer``'s ids (a tool's or the
        environment's message and the next turn's opening), unless there is no room for them and a turn
        after them: then the conversation ends (False)."""
        env = self.offers.chat(c.offer).closing(tokens) + answer
        if len(c.ids) + len(env) >= self.mt.max_total_tokens:
            c.done = True
            return False
        c.ids += env
        c.model += [False] * len(env)
        c.log_probs += [0.0] * len(env)
        return True

    def _spent(self, c: Conversation) -> bool:
        return c.model_tokens >= self.cfg.rollout.max_new_tokens or len(c.ids) >= self.mt.max_total_tokens

    def _cut(self, text: str) -> str:
        """``text`` cut to ``max_tool_response_tokens`` tokens."""
        ids = self.chat.encode(text)
        limit = self.mt.max_tool_response_tokens
        return text if len(ids) <= limit else self.tokenizer.decode(ids[:limit], skip_special_tokens=False)

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
        return metrics_row(convs, stats, drifted, self.environment is not None)

    def drift(self, c: Conversation) -> int | None:
        """The first position after the prompt where the conversation's ids differ from its whole
        rendering (None: none). Before the prompt's end they must agree too (a negative position)."""
        chat = self.offers.chat(c.offer)
        prompt = chat.encode(chat.render(c.messages[: len(prompt_messages(self.cfg.data, c.prompt))], True))
        full = chat.encode(chat.render(c.messages))
        at = first_drift(prompt + c.ids, full)
        return None if at is None else at - len(prompt)
