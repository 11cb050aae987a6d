"""``sandbox``: where and under which limits code a model wrote runs (the built-in python tool under
``rollout.multi_turn.sandbox``, the code rewards under their ``kwargs.sandbox``). The values are checked
here; whether the jail starts on this machine is the preflight's question (``rlctl.sandbox.check``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rlctl.config.strict import Strict
from rlctl.sandbox import Limits

DEFAULT = Limits()


class SandboxConfig(Strict):
    mode: Literal["jail", "unsafe"] = Field(
        "jail",
        description="jail: every run in a bubblewrap jail (no network, the system read-only, no run or home "
        "directory, a private /tmp); unsafe: no jail, the same rlimits only, for a machine where no user "
        "namespace can be made (the code can then read and write what rlctl can). Never chosen for you.",
    )
    binary: str = Field(DEFAULT.binary, description="The bubblewrap program (a name on PATH or a path).")
    cpu_time_s: int = Field(DEFAULT.cpu_time_s, ge=1, description="CPU seconds one run may use (RLIMIT_CPU).")
    wall_time_s: float = Field(
        DEFAULT.wall_time_s, gt=0, description="Seconds one run may last; it is then killed, every process of it."
    )
    memory_mb: int = Field(
        DEFAULT.memory_mb, ge=64, description="Address space of each process of a run, in MB (RLIMIT_AS)."
    )
    processes: int = Field(
        DEFAULT.processes,
        ge=1,
        description="Processes a run may have at once (a pids cgroup where rlctl may make one, RLIMIT_NPROC too).",
    )
    output_kb: int = Field(
        DEFAULT.output_kb, ge=1, description="KB a run may print (stdout and stderr each); past it, it is killed."
    )
    tmp_mb: int = Field(DEFAULT.tmp_mb, ge=1, description="Size of the run's private, writable /tmp in MB.")

    def limits(self) -> Limits:
        return Limits(**self.model_dump())
