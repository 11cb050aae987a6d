"""The outage clock that every writer of the process shares: an outage of a store (an object store's
bucket: scheme and host of the URL; local paths have none) begins with the first attempt that fails
transiently (at that attempt's start, never before the store last answered) and ends with the store's
next answer (a success, a missing file, a refusal). The retry loop (``rlctl.storage.failures``) gives
up once its budget has passed since the outage began; ``OUTAGES.overdue(budget)`` says when one has
lasted the run's budget: the run's fence then ends it (exit 12)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, replace
from urllib.parse import urlsplit

from rlctl.errors import StorageError

LOCAL_SCHEMES = {"", "file", "local", "memory"}


def store_of(url: str) -> str | None:
    """The store a URL lies in, as the outage clock counts it (``s3://bucket``); None for a local
    path and memory:// (no service that can go away)."""
    parts = urlsplit(url)
    if parts.scheme in LOCAL_SCHEMES or not parts.netloc:
        return None
    return f"{parts.scheme}://{parts.netloc}"


@dataclass(frozen=True)
class Outage:
    """A store that has failed since ``since`` without answering (``time.monotonic``, one clock for
    every process of the host); ``last``: its latest failure, ``failure``: that failure's sentence."""

    store: str
    since: float
    last: float
    failure: str
    cause: str = ""  # the failure's cause alone (``failure`` names the action and URL too)

    def began(self) -> str:
        """When it began, on the wall clock (UTC)."""
        return time.strftime("%H:%M:%SZ", time.gmtime(time.time() - (time.monotonic() - self.since)))

    def error(self, budget: float, budget_name: str = "the retry budget") -> StorageError:
        """The sentence that ends a run: what failed, since when, and that the budget is spent."""
        lasted = time.monotonic() - self.since
        return StorageError(
            f"storage outage: {self.store} has failed for {lasted:.0f} s since {self.began()}, longer than "
            f"{budget_name} ({budget:g} s); its last failure: {self.failure}; stopped before the next write, "
            "resume the run once the storage is back"
        )


FORGOTTEN_AFTER = 600.0  # seconds without a failure after which a store's next failure begins a new outage


class Outages:
    """This process's open outages, one per store: begun by the first transient failure, ended by the
    store's first answer. Thread-safe."""

    def __init__(self):
        self._lock = threading.Lock()
        self._open: dict[str, Outage] = {}
        self._answered: dict[str, float] = {}  # when each store last answered

    def failed(self, url: str, action: str, cause: str, tried: float) -> Outage | None:
        """A transient failure to ``action`` ``url`` (``cause``: why) in an attempt begun at ``tried``:
        its store's outage (None for a local path), begun then unless one is open, and never before the
        store's last answer (an attempt that took minutes did not meet an outage that long)."""
        store = store_of(url)
        if store is None:
            return None
        failure = f"cannot {action} {url}: {cause}"
        began = max(tried, self._answered.get(store, tried))
        with self._lock:
            known = self._open.get(store)
            if known is not None and tried - known.last > FORGOTTEN_AFTER:
                known = None  # met again after a long silence: a new outage (a test's, a notebook's)
            since = min(known.since, began) if known else began
            outage = self._open[store] = Outage(store, since, time.monotonic(), failure, cause)
        return outage

    def answered(self, url: str) -> None:
        """The store of ``url`` answered: its outage, if any, is over."""
        store = store_of(url)
        if store is None:
            return
        self._answered[store] = time.monotonic()
        if store in self._open:  # (a cheap look first: this runs on every success)
            with self._lock:
                self._open.pop(store, None)

    def note(self, outage: Outage) -> None:
        """An outage another process saw (the snapshot writer's, carried by its error): this process's
        writers count from its start too."""
        with self._lock:
            known = self._open.get(outage.store)
            if known is not None:
                latest = outage if outage.last >= known.last else known
                outage = replace(latest, since=min(known.since, outage.since))
            self._open[outage.store] = outage

    def current(self, url: str) -> Outage | None:
        """The open outage of the store of ``url``, if any."""
        store = store_of(url)
        return self._open.get(store) if store is not None else None

    def deadline(self, url: str, budget: float) -> float | None:
        """When the open outage of the store of ``url`` will have lasted ``budget`` seconds (monotonic
        time), or None while none is open."""
        outage = self.current(url)
        return outage.since + budget if outage is not None else None

    def overdue(self, budget: float) -> Outage | None:
        """The oldest open outage that has lasted ``budget`` seconds or more, or None."""
        now = time.monotonic()
        with self._lock:
            late = [o for o in self._open.values() if now - o.since >= budget]
        return min(late, key=lambda o: o.since, default=None)

    def clear(self) -> None:
        """Forget every outage (a run's lease counts from its own start)."""
        with self._lock:
            self._open.clear()
            self._answered.clear()


OUTAGES = Outages()  # the process's
