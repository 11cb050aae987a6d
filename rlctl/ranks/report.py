"""How a run shows its progress: the Reporter protocol (``rlctl.commands.progress`` draws one on
stderr) and a reporter that shows nothing (library calls, ranks other than the driver)."""

from __future__ import annotations

from typing import Any, Protocol


class Reporter(Protocol):
    def ready(self, step: int, total: int) -> None: ...

    def step(self, row: dict[str, Any]) -> None: ...

    def note(self, text: str) -> None: ...


class SilentReporter:
    """A Reporter that shows nothing."""

    def ready(self, step: int, total: int) -> None: ...

    def step(self, row: dict[str, Any]) -> None: ...

    def note(self, text: str) -> None: ...
