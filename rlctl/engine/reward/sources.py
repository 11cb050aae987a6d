"""The run's reward: one source or several weighted ones (functions, HTTP endpoints, reward models), summed.

``load_reward(cfg.reward)`` gives a ``RewardSources``, itself a reward function
``fn(prompts, completions, **columns) -> list[float]``, so the code that scores completions does not
know how many sources there are. Each source's result is checked on its own (an InputError names that
source); the step's score is ``sum(weight * score)``. With ``reward.sources``, ``recording(fn)`` collects
each source's mean over the completions scored within the block, as ``critic/score/<name>/mean``
(declared for the ranks in ``metrics_of(fn)``: MEAN, since every rank scores an equal share). A function
with metrics of its own (``score_metrics``, e.g. the code rewards' ``reward/code/*``) gives them too. The
single-source shorthands (``reward.function``, ``reward.url``, ``reward.model``) log no per-source mean:
it would repeat ``critic/score/mean``. A reward model source (shorthand included) also logs
``critic/score/<name>/truncated_frac``: the fraction of the block's texts cut from the left to its context.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from rlctl.config.reward import RewardConfig, RewardSourceConfig
from rlctl.engine.dist import MEAN
from rlctl.engine.reward.loader import load_reward_fn
from rlctl.engine.reward.model import ModelReward
from rlctl.engine.reward.remote import RemoteReward
from rlctl.engine.reward.scores import check_scores, score_completions


@dataclass
class Source:
    """One reward source: its metric name, weight, the callable and how errors name it."""

    name: str
    weight: float
    fn: Callable[..., Any]
    spec: str  # ``module:function``, the URL or the model's directory
    kwargs: dict[str, Any] = field(default_factory=dict)
    what: str | None = None  # how errors name a source of ours ("reward URL"); None: a user's function

    def score(
        self, prompts: list[str], completions: list[str], columns: dict[str, list], turns: list | None = None
    ) -> list[float]:
        """One checked float per completion; a function is called as untrusted code, a URL or model is ours.
        ``turns``: a function's per-turn rewards (``check_scores``)."""
        if self.what is None:
            return score_completions(self.fn, self.spec, prompts, completions, columns, self.kwargs, turns)
        return check_scores(self.spec, self.fn(prompts, completions, **columns), len(completions), what=self.what)


class RewardSources:
    """A reward function summing weighted sources; see the module's docstring."""

    def __init__(self, sources: list[Source], per_source: bool):
        """``per_source``: record each source's mean (``reward.sources``); else none (a shorthand)."""
        self.sources, self.per_source = sources, per_source
        self._sums: dict[str, list[float]] | None = None  # name -> [sum, count] while recording

    @property
    def spec(self) -> str:
        """How errors name the sum."""
        return self.sources[0].spec if len(self.sources) == 1 else "reward.sources (weighted sum)"

    def __call__(self, prompts: list[str], completions: list[str], **columns: list) -> list[float]:
        """The weighted sum of every source's scores, one per completion."""
        return self.score_batch(prompts, completions, columns)

    def score_batch(
        self, prompts: list[str], completions: list[str], columns: dict[str, list], turns: list | None = None
    ) -> list[float]:
        """The weighted sum of the sources' checked scores (InputError naming the source that failed), and
        into ``turns`` (a multi-turn rollout's) the weighted sum of their per-turn rewards."""
        if len(self.sources) == 1 and self.sources[0].weight == 1.0 and self._sums is None:
            return self.sources[0].score(prompts, completions, columns, turns)
        total = [0.0] * len(completions)
        for source in self.sources:
            own = [None] * len(completions) if turns is not None else None
            scores = source.score(prompts, completions, columns, own)
            earned = [s + sum(t or ()) for s, t in zip(scores, own or [None] * len(scores))]
            if self._sums is not None:
                acc = self._sums.setdefault(source.name, [0.0, 0.0])
                acc[0], acc[1] = acc[0] + sum(earned), acc[1] + len(scores)
            total = [t + source.weight * s for t, s in zip(total, scores)]
            for i, rewards in enumerate(own or ()):
                if rewards:
                    turns[i] = added(turns[i] or [], [source.weight * r for r in rewards])
        return check_scores(self.spec, total, len(completions), what="reward")

    @contextlib.contextmanager
    def recording(self) -> Iterator[dict[str, float]]:
        """Within the block, each source's scores are counted; at its end the dict yielded holds
        ``critic/score/<name>/mean`` for every source (none for a shorthand) and
        ``critic/score/<name>/truncated_frac`` for every reward model."""
        self._sums, out = {}, {}
        models = [s for s in self.sources if isinstance(s.fn, ModelReward)]
        for source in models:
            source.fn.truncated = 0
        hooks = self._score_metrics()
        for hook in hooks:
            hook.take()  # what scoring outside a block (validation) counted is not this block's
        try:
            yield out
        finally:
            sums, self._sums = self._sums, None
        for hook in hooks:
            out.update(hook.take())
        if self.per_source:
            for source in self.sources:
                total, count = sums.get(source.name, (0.0, 0.0))
                out[metric_name(source.name)] = total / count if count else 0.0
        for source in models:
            count = sums.get(source.name, (0.0, 0.0))[1]
            out[truncated_name(source.name)] = source.fn.truncated / count if count else 0.0

    def _score_metrics(self) -> list[Any]:
        """The functions' own metrics (their ``score_metrics``: ``reductions`` and ``take()``, e.g. the
        code rewards' reward/code/*), each once."""
        hooks = [getattr(s.fn, "score_metrics", None) for s in self.sources if s.what is None]
        return list({id(h): h for h in hooks if h is not None}.values())

    @property
    def metrics(self) -> dict[str, str]:
        """How the ranks reduce the metrics ``recording`` gives."""
        means = {metric_name(s.name): MEAN for s in self.sources} if self.per_source else {}
        own = {key: how for hook in self._score_metrics() for key, how in hook.reductions.items()}
        return {**means, **{truncated_name(s.name): MEAN for s in self.sources if isinstance(s.fn, ModelReward)}, **own}


def metric_name(name: str) -> str:
    """The metric of the source ``name``'s mean score."""
    return f"critic/score/{name}/mean"


def truncated_name(name: str) -> str:
    """The metric of the fraction of texts the reward model ``name`` saw cut to its context."""
    return f"critic/score/{name}/truncated_frac"


def load_reward(cfg: RewardConfig, device: torch.device | str = "cpu") -> RewardSources:
    """The reward ``cfg`` describes; every function source is imported (ConfigError or InputError as
    ``load_reward_fn`` says), every reward model's directory checked (InputError naming its key; its
    weights load on ``device``, the rank's, at its first call). A URL is not contacted here."""
    if cfg.sources is None:
        keyed = [(s, "reward.model.path") for s in cfg.source_list()]
    else:
        keyed = [(s, f"reward.sources[{i}].model.path") for i, s in enumerate(cfg.sources)]
    return RewardSources([_load_source(s, key, device) for s, key in keyed], per_source=cfg.sources is not None)


def _load_source(s: RewardSourceConfig, key: str, device: torch.device | str) -> Source:
    """One source; ``key`` names a reward model's directory in its errors."""
    if s.function is not None:
        fn = load_reward_fn(s.function)
        if callable(hook := getattr(fn, "check_kwargs", None)):  # e.g. the code rewards' sandbox, started once
            hook(s.kwargs, key.removesuffix(".model.path") + ".kwargs")
        return Source(s.label, s.weight, fn, s.function, s.kwargs)
    if s.model is not None:
        return Source(s.label, s.weight, ModelReward(s.model, key, device), s.model.path, what="reward model")
    fn = RemoteReward(s.url, s.timeout, s.retries, s.kwargs)
    return Source(s.label, s.weight, fn, s.url, what="reward URL")


@contextlib.contextmanager
def recording(fn: Callable[..., Any]) -> Iterator[dict[str, float]]:
    """``fn.recording()`` for a RewardSources; an empty dict for a plain reward function."""
    if isinstance(fn, RewardSources):
        with fn.recording() as out:
            yield out
    else:
        yield {}


def metrics_of(fn: Callable[..., Any]) -> dict[str, str]:
    """The reductions of the per-source metrics ``recording(fn)`` gives (none for a plain function)."""
    return fn.metrics if isinstance(fn, RewardSources) else {}


def added(a: list[float], b: list[float]) -> list[float]:
    """``a + b`` element by element, the shorter padded with zeros (two sources' rewards of the turns)."""
    n = max(len(a), len(b))
    return [(a[k] if k < len(a) else 0.0) + (b[k] if k < len(b) else 0.0) for k in range(n)]
