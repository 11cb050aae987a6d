"""Reward functions, loaded by ``module:function`` like any user's, and called as untrusted code.

A reward function is called once per step as ``fn(prompts, completions, **columns, **kwargs)`` where
``prompts`` and ``completions`` are lists of strings of equal length (each prompt repeated
``group_size`` times) and ``columns`` are the dataset's other columns, aligned the same way. It returns
one finite number per completion (a list, tuple, 1-D numpy array or tensor; ints, floats, numpy numbers
and bools count). This is the signature TRL's reward functions use, so they carry over. Under a
multi-turn rollout an item may instead be ``{"score": number, "turns": [number, ...]}``: rewards of the
model's single turns besides the score (``check_scores``).

The module's import and every call are user code: whatever they raise or exit with (an exception,
``SystemExit`` even with code 0, a ``KeyboardInterrupt`` they raise themselves, ``GeneratorExit``) is an
InputError naming ``module:function`` and the cause, and so is a result that is not one finite number
per completion. A real Ctrl-C during the call stays a ``KeyboardInterrupt`` (exit 130): while user code
runs in the main thread, a SIGINT handler notes that the signal arrived and then does what the handler
before it did. (Where that handler was not set from Python, a ``KeyboardInterrupt`` is taken as real.)
"""

from __future__ import annotations

import importlib
import math
import numbers
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType
from typing import Any, Protocol, TypeVar, runtime_checkable

from rlctl.errors import ConfigError, InputError, Stopped

RewardFn = Callable[..., list[float]]


@runtime_checkable
class BatchScorer(Protocol):
    """A reward rlctl composes itself (``sources.RewardSources``): it calls and checks its own sources."""

    def score_batch(
        self, prompts: list[str], completions: list[str], columns: dict[str, list], turns: list | None = None
    ) -> list[float]:
        """One checked float per completion (``turns``: as for ``check_scores``)."""
        ...


T = TypeVar("T")
FLOAT32_MAX = 3.4028234663852886e38  # scores are kept as float32: a larger one would become inf


# --------------------------------------------------------------------------------------------------
# Calling user code


class _RealInterrupt:
    """Within the block (main thread only), whether a real SIGINT arrived; the handler that was there
    before still runs (``default_int_handler`` raises KeyboardInterrupt, SIG_IGN ignores it, SIG_DFL
    ends the process)."""

    def __enter__(self) -> _RealInterrupt:
        self.arrived = False
        self.previous: Any = None
        self.unknown = False  # a KeyboardInterrupt cannot be told apart: take it as real
        if threading.current_thread() is threading.main_thread():
            self.previous = signal.getsignal(signal.SIGINT)
            if self.previous is None:  # set outside Python: not ours to replace
                self.unknown = True
            else:
                signal.signal(signal.SIGINT, self._on_sigint)
        return self

    def _on_sigint(self, signum: int, frame: Any) -> None:
        self.arrived = True
        if callable(self.previous):
            self.previous(signum, frame)
        elif self.previous == signal.SIG_DFL:
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)

    @property
    def real(self) -> bool:
        return self.arrived or self.unknown


def call_user_code(what: str, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)``; anything it raises or exits with becomes an InputError ``"{what}
    raised {cause}"``, except a KeyboardInterrupt that a real SIGINT caused."""
    with _RealInterrupt() as interrupt:
        try:
            return fn(*args, **kwargs)
        except BaseException as exc:  # user code may exit or raise anything
            if isinstance(exc, Stopped) or (isinstance(exc, KeyboardInterrupt) and interrupt.real):
                raise  # a stop or a Ctrl-C that really came while user code ran is not the code's fault
            raise InputError(f"{what} raised {describe_exception(exc)}") from None


def describe_exception(exc: BaseException) -> str:
    """``ValueError: boom (/x/mod.py:5)``, ``SystemExit(0) (...)``, ``SyntaxError: invalid syntax
    (/x/mod.py:3)``: the type, the message on one line and where it was raised."""
    if isinstance(exc, SystemExit):
        return f"SystemExit({exc.code!r}){_where(exc)}"
    if isinstance(exc, SyntaxError):
        return f"{type(exc).__name__}: {exc.msg} ({exc.filename}:{exc.lineno})"
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}{': ' + text if text else ''}{_where(exc)}"


def _where(exc: BaseException | None) -> str:
    """`` (FILE:LINE)`` of the innermost frame outside Python's import machinery, or ''."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith("<")] if exc else []
    return f" ({frames[-1].filename}:{frames[-1].lineno})" if frames else ""


# --------------------------------------------------------------------------------------------------
# Loading


def load_reward_fn(spec: str) -> RewardFn:
    """The function named by ``module:function``. A module or function that does not exist is a
    ConfigError (the config names something that is not there); a module whose import fails is an
    InputError naming the cause."""
    module_name, _, fn_name = spec.partition(":")
    # The console script does not put the working directory on sys.path; a reward module next to the
    # config is the common case, so look there too (as uvicorn does for its apps).
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    module = call_user_code(f"reward function '{spec}': importing module '{module_name}'", _import, module_name)
    if module is None:
        raise ConfigError(f"'reward.function': cannot import module '{module_name}' (No module named '{module_name}')")
    fn = call_user_code(f"reward function '{spec}': looking it up", getattr, module, fn_name, None)
    if not callable(fn):
        names = sorted(n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n, None)))
        raise ConfigError(
            f"'reward.function': module '{module_name}' has no function '{fn_name}'"
            + (f" (it has: {', '.join(names[:10])})" if names else "")
        )
    return fn


def _import(name: str) -> Any:
    """The module, or None when it (or a package above it) does not exist; a module that exists but
    fails to import raises (a missing import inside it included)."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name and (name == exc.name or name.startswith(exc.name + ".")):
            return None
        raise


# --------------------------------------------------------------------------------------------------
# Scoring


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
