"""A reward's scores checked: one finite number per completion (a list, tuple, 1-D numpy array or
tensor; ints, floats, numpy numbers and bools count), or under a multi-turn rollout an item
``{"score": number, "turns": [number, ...]}``; anything else is an InputError naming the reward, the
value and the completion's index."""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from rlctl.engine.reward.loader import RewardFn
from rlctl.errors import InputError
from rlctl.usercode import call_user_code

FLOAT32_MAX = 3.4028234663852886e38  # scores are kept as float32: a larger one would become inf


@runtime_checkable
class BatchScorer(Protocol):
    """A reward rlctl composes itself (``sources.RewardSources``): it calls and checks its own sources."""

    def score_batch(
        self, prompts: list[str], completions: list[str], columns: dict[str, list], turns: list | None = None
    ) -> list[float]:
        """One checked float per completion (``turns``: as for ``check_scores``)."""
        ...


def score_completions(
    fn: RewardFn,
    spec: str,
    prompts: list[str],
    completions: list[str],
    columns: dict[str, list],
    kwargs: dict,
    turns: list | None = None,
) -> list[float]:
    """One float per completion from the reward function ``fn`` (named ``spec``), called as untrusted
    code; an InputError naming it, the value and the completion's index for anything else. A
    ``BatchScorer`` (the run's ``load_reward``) scores with its own sources and kwargs. ``turns``: as for
    ``check_scores``."""
    if isinstance(fn, BatchScorer):
        return fn.score_batch(prompts, completions, columns, turns)
    scores = call_user_code(f"reward function '{spec}'", fn, prompts, completions, **columns, **kwargs)
    return check_scores(spec, scores, len(completions), turns=turns)


def check_scores(
    spec: str, scores: Any, n: int, what: str = "reward function", turns: list | None = None
) -> list[float]:
    """``scores`` as n floats when it is a sequence of n finite real numbers; else an InputError naming
    ``what`` and ``spec``. With ``turns`` (n slots: a multi-turn rollout's), an item may also be
    ``{"score": number, "turns": [number, ...]}``: its score is the float, its turns' rewards go to
    ``turns[index]`` (the model's turns in order, each on its turn's last token)."""
    expected = f"expected a list of {n} finite numbers, one per completion"
    if hasattr(scores, "ndim") and hasattr(scores, "tolist"):  # a numpy array or a tensor
        if scores.ndim != 1:
            raise InputError(f"{what} '{spec}' returned a {scores.ndim}-d array; {expected}")
        scores = scores.tolist()
    if isinstance(scores, (str, bytes)) or not isinstance(scores, Sequence):
        raise InputError(f"{what} '{spec}' returned {_show_result(scores)}; {expected}")
    if len(scores) != n:
        raise InputError(f"{what} '{spec}' returned {len(scores)} scores for {n} completions")
    out = []
    for index, value in enumerate(scores):
        if turns is not None and isinstance(value, Mapping):
            value = _with_turns(f"{what} '{spec}'", value, index, turns)
        number = finite_number(value)
        if number is None:
            hint = (
                " (per-turn rewards, {'score': ..., 'turns': [...]}, need rollout.multi_turn)"
                if isinstance(value, Mapping)
                else ""
            )
            raise InputError(
                f"{what} '{spec}' returned {_short(repr(value))} for completion {index}; "
                f"expected one finite number per completion{hint}"
            )
        out.append(number)
    return out


def _with_turns(who: str, value: Mapping, index: int, turns: list) -> Any:
    """The score of a ``{"score": ..., "turns": [...]}`` item; its turns' rewards into ``turns[index]``."""
    rewards = value.get("turns", [])
    numbers_ = [finite_number(r) for r in rewards] if isinstance(rewards, (list, tuple)) else [None]
    if set(value) - {"score", "turns"} or "score" not in value or None in numbers_:
        raise InputError(
            f"{who} returned {_short(repr(dict(value)))} for completion {index}; expected a number or "
            "{'score': number, 'turns': [one number per turn of the model's, in order]}"
        )
    turns[index] = numbers_
    return value["score"]


def finite_number(value: Any) -> float | None:
    """``value`` as a float when it is a real number finite in float32 (bools, numpy numbers and 0-d
    arrays or tensors included); else None."""
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):
        value = value.item()
    if type(value).__name__ == "bool_":  # numpy's bool is no numbers.Real
        value = bool(value)
    if not isinstance(value, numbers.Real):
        return None
    try:
        number = float(value)
    except (OverflowError, ValueError, TypeError):
        return None
    return number if math.isfinite(number) and abs(number) <= FLOAT32_MAX else None


def _show_result(value: Any) -> str:
    if value is None or isinstance(value, (str, bytes, numbers.Number)):
        return _short(repr(value))
    return f"a {type(value).__name__}"


def _short(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
