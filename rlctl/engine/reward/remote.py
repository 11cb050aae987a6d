"""A reward served over HTTP: the batch is POSTed as JSON and the endpoint answers one score per completion.

The request body is ``{"prompts": [...], "completions": [...], <column>: [...], "kwargs": {...}}``: the
dataset's other columns aligned with the completions like a reward function's ``**columns``, and
``kwargs`` only when the config gives some. The body is strict JSON: a NaN or infinity anywhere in it (a
float column with a missing value) is an InputError naming the column and row before any request, since
JSON has no such numbers (``json.dumps`` would write a bare ``NaN`` that strict servers refuse). The
answer must be ``{"scores": [...]}``: one finite number per completion (JSON ``NaN``/``Infinity`` are
refused like a function's).

Connection errors, timeouts (``timeout`` seconds per request), 5xx and 429 are retried ``retries`` times
with exponential backoff (1, 2, 4 ... seconds, at most 30), or after the answer's ``Retry-After`` (at
most 120 seconds). When the endpoint stays down, an InputError names the URL, the attempts and the last
error; a 4xx other than 429, a body that is not the JSON above, or the wrong number of scores is an
InputError at once. A stop signal (SIGTERM, SIGUSR1) during a backoff ends the wait at once: its handler
runs as before, then the wait raises ``Stopped``.
"""

from __future__ import annotations

import email.utils
import http.client
import json
import math
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

from rlctl.errors import InputError, Stopped

BACKOFF_MAX = 30.0  # seconds: the longest wait between two attempts of our own choosing
RETRY_AFTER_MAX = 120.0  # seconds: the longest Retry-After honoured
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)  # (rlctl.ranks.stops's: engine/ cannot import ranks/)


class _Retryable(Exception):
    """A failure worth another attempt; ``retry_after`` is the server's wish in seconds, if it said."""

    def __init__(self, message: str, retry_after: float | None = None):
        super().__init__(message)
        self.retry_after = retry_after


class RemoteReward:
    """Scores completions by POSTing them to ``url``; see the module's docstring for the protocol."""

    def __init__(
        self,
        url: str,
        timeout: float = 30.0,
        retries: int = 3,
        kwargs: dict[str, Any] | None = None,
        backoff: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        """``backoff``: the first wait in seconds (doubled each retry, at most BACKOFF_MAX)."""
        self.url, self.timeout, self.retries, self.kwargs = url, timeout, retries, dict(kwargs or {})
        self.backoff, self.clock = backoff, clock

    def __call__(self, prompts: list[str], completions: list[str], **columns: list) -> Any:
        """The scores as the endpoint gave them (checked by the caller: ``score``)."""
        body = self._body(prompts, completions, columns)
        last: _Retryable | None = None
        with _StopWatch() as stop:  # (from the first request: a stop signal during one cuts the backoff after it)
            for attempt in range(1, self.retries + 2):
                try:
                    return self._post(body)
                except _Retryable as exc:
                    last = exc
                if attempt <= self.retries:
                    delay = last.retry_after if last.retry_after is not None else self.backoff * 2 ** (attempt - 1)
                    cap = RETRY_AFTER_MAX if last.retry_after is not None else BACKOFF_MAX
                    _wait(min(delay, cap), self.clock, stop)
        attempts = self.retries + 1
        raise InputError(
            f"reward URL {self.url} did not answer after {attempts} attempt{'s' if attempts > 1 else ''} "
            f"(reward timeout {self.timeout:g}s, {self.retries} retries); last error: {last}"
        )

    def _body(self, prompts: list[str], completions: list[str], columns: dict[str, list]) -> bytes:
        """The request's JSON; a column that JSON cannot hold is an InputError naming it."""
        payload: dict[str, Any] = {"prompts": prompts, "completions": completions, **columns}
        if self.kwargs:
            payload["kwargs"] = self.kwargs
        try:
            return json.dumps(payload, default=_plain, allow_nan=False).encode()
        except (TypeError, ValueError) as exc:
            where = _non_finite(payload)
            if where is not None:
                raise InputError(
                    f"reward URL {self.url}: {where} is not a finite number, and strict JSON has no NaN or "
                    "Infinity; clean that column of the dataset (or drop it) before training"
                ) from None
            raise InputError(f"reward URL {self.url}: the batch cannot be sent as JSON ({exc})") from None

    def _post(self, body: bytes) -> Any:
        """One POST: the answer's ``scores``; _Retryable for what another attempt may cure."""
        request = urllib.request.Request(
            self.url, data=body, method="POST", headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                data = response.read()
        except urllib.error.HTTPError as exc:
            raise self._http_error(exc) from None
        except urllib.error.URLError as exc:
            raise _Retryable(f"cannot connect: {exc.reason}") from None
        except (TimeoutError, ConnectionError, http.client.HTTPException, OSError) as exc:
            text = f"no answer within {self.timeout:g}s" if isinstance(exc, TimeoutError) else _describe(exc)
            raise _Retryable(text) from None
        return self._scores(data)

    def _http_error(self, exc: urllib.error.HTTPError) -> Exception:
        """A 5xx or 429 to retry (with its Retry-After); any other status an InputError at once."""
        detail = _snippet(exc.read() if exc.fp is not None else b"")
        said = f"HTTP {exc.code} {exc.reason}" + (f": {detail}" if detail else "")
        if exc.code == 429 or exc.code >= 500:
            return _Retryable(said, retry_after(exc.headers.get("Retry-After") if exc.headers else None))
        return InputError(f"reward URL {self.url} answered {said}")

    def _scores(self, data: bytes) -> Any:
        """The ``scores`` of a JSON answer; an InputError for any other body."""
        try:
            answer = json.loads(data)
        except (ValueError, UnicodeDecodeError):
            raise InputError(
                f"reward URL {self.url} answered a body that is not JSON: {_snippet(data) or '(empty)'}"
            ) from None
        if not isinstance(answer, dict) or "scores" not in answer:
            raise InputError(
                f'reward URL {self.url} answered {_snippet(data)}; expected a JSON object {{"scores": [...]}}'
            )
        return answer["scores"]


def retry_after(value: str | None) -> float | None:
    """Seconds from a Retry-After header (delta-seconds or an HTTP date); None when absent or unreadable."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def _wait(seconds: float, clock: Callable[[], float], stop: _StopWatch) -> None:
    """Sleep ``seconds``, cut short by a stop signal ``stop`` noted, before or during the sleep: its handler
    ran as before, and Stopped is raised (where the handler raised already, that went through). Off the
    main thread signals cannot arrive."""
    end = clock() + seconds
    while stop.signal_name is None and (left := end - clock()) > 0:
        time.sleep(min(left, 0.1))
    if stop.signal_name is not None:
        raise Stopped(stop.signal_name)


class _StopWatch:
    """Within the block (main thread only), notes a stop signal after running the handler there before."""

    def __enter__(self) -> _StopWatch:
        self.signal_name: str | None = None
        self.previous: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                old = signal.getsignal(sig)
                if callable(old):  # SIG_DFL ends the process anyway; SIG_IGN and None: not ours to change
                    self.previous[sig] = old
                    signal.signal(sig, self._on_signal)
        return self

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.signal_name = signal.Signals(signum).name
        self.previous[signum](signum, frame)

    def __exit__(self, *exc_info: Any) -> None:
        for sig, old in self.previous.items():
            signal.signal(sig, old)


def _plain(value: Any) -> Any:
    """A numpy array or number, or a tensor, as plain Python for JSON; else TypeError."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"a {type(value).__name__} is not JSON")


def _non_finite(payload: dict[str, Any]) -> str | None:
    """Where the request's first NaN or infinity is, in words ("column 'target' row 3 (nan)"); else None."""
    for name, column in payload.items():
        column = column.tolist() if hasattr(column, "tolist") else column
        rows = enumerate(column) if isinstance(column, list) else [(None, column)]
        for row, value in rows:
            found = _first_non_finite(value)
            if found is not None:
                at, bad = found
                what = "kwargs" if name == "kwargs" else f"column '{name}'"
                return f"{what}{'' if row is None else f' row {row}'}{at} ({bad})"
    return None


def _first_non_finite(value: Any, at: str = "") -> tuple[str, float] | None:
    """(the path inside ``value``, e.g. "['score']", and the value) of its first NaN or infinity."""
    if not isinstance(value, (str, bytes, dict, list, tuple, float, int)) and hasattr(value, "tolist"):
        value = value.tolist()  # (a numpy array or number, a tensor: as _plain sends it)
    if isinstance(value, float):
        return None if math.isfinite(value) else (at, value)
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, (list, tuple)) else ()
    for key, item in items:
        found = _first_non_finite(item, f"{at}[{key!r}]")
        if found is not None:
            return found
    return None


def _describe(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}{': ' + text if text else ''}"


def _snippet(data: bytes, limit: int = 200) -> str:
    text = " ".join(data.decode("utf-8", "replace").split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
