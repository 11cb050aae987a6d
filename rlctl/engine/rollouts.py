"""The rank's rollouts and what multi-turn ones call: the tools, the pool of tool workers, the count of
steps with the tools down, and the rollout backends built over an actor (the trainer's own, and the
generator of an overlapped rollout, each with a pool of its own)."""

from __future__ import annotations

from pathlib import Path

from rlctl.config import RunConfig
from rlctl.engine.rollout import make_backend
from rlctl.engine.rollout.trajectory import TrajectoryLog
from rlctl.engine.tool_workers.budget import ToolRetryBudget
from rlctl.engine.tool_workers.call_record import ToolRecord
from rlctl.engine.tool_workers.loader import load_tools
from rlctl.engine.tool_workers.pool import ToolPool
from rlctl.rundir.handle import RunDir


class Rollouts:
    """Under rollout.multi_turn: its ``tools`` (loaded once), the rank's ``pool`` of tool workers (each
    started at its first call; ``close`` ends them) and the ``budget`` of steps with the tools down
    (tool_retry_budget; past it, the run stops as a preemption does). Without multi_turn all three are
    None."""

    def __init__(self, cfg: RunConfig, run: RunDir, rank: int, world: int, model_dir: Path):
        self.cfg, self.run, self.rank, self.world, self.model_dir = cfg, run, rank, world, model_dir
        mt = cfg.rollout.multi_turn
        self.tools = load_tools(mt) if mt is not None else None
        self.pool = self.new_pool()
        self.budget = ToolRetryBudget(mt.tool_retry_budget) if mt is not None else None

    def new_pool(self) -> ToolPool | None:
        """A pool of tool workers of its own (None without multi_turn)."""
        mt = self.cfg.rollout.multi_turn
        return ToolPool(mt.tool_workers, mt.tool_timeout_s, mt.sandbox.limits()) if mt is not None else None

    def make(self, name: str, actor, tokenizer, pool: ToolPool | None, emit, engine=None):
        """A rollout backend over ``actor`` (the actor, or a copy generating beside it); with a ``pool`` of
        tool workers, the run's record of tool calls and its trajectories; ``engine``: a vLLM rollout to
        generate with rather than a new engine (an overlapped rollout shares the trainer's)."""
        return make_backend(
            name,
            cfg=self.cfg,
            actor=actor,
            tokenizer=tokenizer,
            model_dir=self.model_dir,
            engine=engine,
            emit=emit,
            tools=self.tools,
            pool=pool,
            record=ToolRecord(self.run, self.rank, self.world) if pool is not None else None,
            trajectories=TrajectoryLog(self.run, self.rank) if pool is not None else None,
        )

    def close(self) -> None:
        """End the pool's workers, however training ends (a dead trainer's workers see EOF and exit)."""
        if self.pool is not None:
            self.pool.close()
