"""Ranks as Ray actors (``cluster.backend: ray``).

A placement group reserves ``trainer.nnodes`` bundles, one per node (STRICT_SPREAD over several nodes,
PACK on one), each holding ``trainer.n_devices_per_node`` ranks: ``cluster.cpus_per_rank`` CPUs and,
on CUDA, one GPU per rank (a custom ``NPU`` resource on Ascend). Rank 0's actor publishes its node
address and its store's port; every actor then joins one torch.distributed group and runs the rank's
session to the end. Rank 0's actor binds the group's store server once, on a port its node's system
chooses (``bind_rendezvous``), and holds it while the run lasts: no port is probed and bound later.
Each actor works in a temp folder of its own for the run (``rlctl.ranks.tmpdir``). Actors are threaded (two calls at once) so the driver can forward a stop while a
rank trains.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from typing import Any

from rlctl.config import RunConfig
from rlctl.errors import ConfigError
from rlctl.ranks.nodes import CRASHED, NodeWatch, Reach
from rlctl.ranks.report import Reporter
from rlctl.ranks.stops import STOPS
from rlctl.ranks.supervise import StopForwarder, supervise
from rlctl.ranks.tmpdir import run_tempdir
from rlctl.ranks.worker import rank_main, rank_spec
from rlctl.rundir.selection import ResumePlan
from rlctl.storage import Storage

READY_TIMEOUT_S = 120.0
LOCAL_RAY_CONFIG = {"prestart_worker_first_driver": False, "enable_worker_prestart": False}
_PASS_ENV = (
    "RLCTL_",
    "HF_",
    "TRANSFORMERS_",
    "TORCH_EXTENSIONS_DIR",
    "TOKENIZERS_",
    "TORCH_DEVICE_BACKEND_AUTOLOAD",
    "FSSPEC_",
    "AWS_",
    "GOOGLE_",
    "GCSFS_",
)


def _named(var: str, names: list[str]) -> bool:
    """Whether cluster.env_vars names ``var`` (a name, or a prefix ending in *)."""
    return any(var.startswith(n[:-1]) if n.endswith("*") else var == n for n in names)


class RankActor:
    def node(self) -> dict[str, str]:
        """The Ray node this actor runs on: {"id", "ip"}."""
        import ray

        return {"id": ray.get_runtime_context().get_node_id(), "ip": ray.util.get_node_ip_address()}

    def ping(self) -> None:
        """Answered while the actor (and its node) is there (``nodes.Reach``)."""

    def rendezvous(self, world: int, port: int | None) -> dict[str, Any]:
        """Bind the group's store server here (rank 0's actor), on ``port`` (the driver's user-set
        MASTER_PORT) or one the system chooses, and keep it while the actor lives: {"port"}, or
        {"error"} (a sentence: a ConfigError's)."""
        from rlctl.engine.rendezvous import bind_rendezvous

        try:
            self._store = bind_rendezvous(world, port)
        except ConfigError as exc:
            return {"error": exc.message}
        return {"port": self._store.port}

    def run(self, spec: dict[str, Any], rank: int, local_rank: int, local_world: int, addr: str, port: int) -> dict:
        # the driver's working directory where this node has it (a shared filesystem, the driver's own node):
        # the reward and tool modules beside the config, and relative paths, are found as on the driver
        if os.path.isdir(spec["cwd"]):
            os.chdir(spec["cwd"])
        with run_tempdir(spec["run_url"], remove_at_end=True):  # (the actor is killed once its rank ends)
            return rank_main(spec, rank, local_rank, local_world, addr, port)

    def stop(self, reason: str) -> None:
        STOPS.request(reason)


class ActorStop:
    """A rank's actor as a stop forwarder's target, before its ``run`` starts (the actor keeps the stop
    for its trainer)."""

    def __init__(self, actor):
        self.actor = actor

    def stop(self, signal_name: str) -> None:
        self.actor.stop.remote(signal_name)


class RayRank:
    """A rank's actor and its running ``run`` call, as a supervisor's RankHandle; ``reach`` says when its
    node is lost (then the rank ends with ExitCode.NODE_LOST)."""

    def __init__(self, rank: int, actor, ref, reach: Reach):
        self.rank, self.actor, self.ref, self.reach = rank, actor, ref, reach
        self._code: int | None = None
        self._result: dict[str, Any] | None = None
        self._failure: BaseException | None = None  # the actor's death or unreachability ended ``run``

    def poll(self) -> int | None:
        import ray
        from ray.exceptions import RayActorError

        if self._code is None and self._failure is None and ray.wait([self.ref], timeout=0)[0]:
            try:
                self._end(ray.get(self.ref))
            except RayActorError as exc:  # its process died, or its node is lost: ``reach`` decides
                self._failure = exc
            except Exception as exc:  # the rank crashed: a bug
                self._end(self._crash(exc))
        if self._code is None:
            verdict = self.reach.verdict(self._failure)
            if verdict == CRASHED:
                self._end(self._crash(self._failure or self.reach.died))
            elif verdict is not None:
                self._end(self.reach.lost(self.rank, verdict))
        return self._code

    def _end(self, result: dict[str, Any]) -> None:
        self._result, self._code = result, result["code"]

    def _crash(self, exc: BaseException | None) -> dict[str, Any]:
        text = str(exc).strip()
        last = text.splitlines()[-1] if text else ""
        return {"code": 1, "message": f"rank {self.rank} crashed: {type(exc).__name__}: {last}", "summary": None}

    def stop(self, signal_name: str) -> None:
        self.actor.stop.remote(signal_name)

    def kill(self) -> None:
        """End the actor; one out of reach already (its ``run`` failed with the actor's death or loss) ends
        only once its node's verdict is in (``poll``): its node may be lost, which is why the others
        failed (a survivor's collective with a dead peer fails at once where the peer's connections are
        reset, long before Ray declares the node dead)."""
        import ray

        if self._code is None and not self.reach.killed:
            ray.kill(self.actor)
            self.reach.killed = True
            if self._failure is None:
                self._code, self._result = -int(signal.SIGKILL), None

    def result(self) -> dict[str, Any] | None:
        return self._result


def _device_resources(cfg: RunConfig, cluster: dict[str, float]) -> dict[str, float]:
    """Accelerators each rank reserves: a GPU on CUDA, an NPU (custom resource) on Ascend. With
    device: auto the cluster's resources decide (the driver may be a CPU-only head node)."""
    if cfg.device == "cuda" or (cfg.device == "auto" and cluster.get("GPU", 0) > 0):
        return {"GPU": 1.0}
    if cfg.device == "npu" or (cfg.device == "auto" and cluster.get("NPU", 0) > 0):
        return {"NPU": 1.0}
    return {}


def launch_ray(
    run: Storage,
    cfg: RunConfig,
    plan: ResumePlan | None,
    reporter: Reporter,
    *,
    fence: Callable[[], None] | None = None,
    lease_owner: str | None = None,
) -> dict[str, Any]:
    """Run the ranks of ``cfg`` as Ray actors (connecting to ``cluster.address`` or starting a local
    Ray) and follow them to the run's outcome (``fence`` and ``lease_owner``: the driver's lease, see
    ``supervise`` and ``rank_spec``)."""
    try:
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
    except ImportError:
        raise ConfigError(
            "cluster.backend is 'ray' but Ray is not installed: pip install 'rlctl[ray]' (or use "
            "cluster.backend: local with --nproc)"
        ) from None
    t = cfg.trainer
    nnodes, per_node = t.nnodes, t.n_devices_per_node or t.nproc
    started_here = not ray.is_initialized()
    if started_here:
        reporter.note(f"connecting to Ray at {cfg.cluster.address}" if cfg.cluster.address else "starting a local Ray")
        ray.init(
            # "local": a Ray of its own even where RAY_ADDRESS is set or `ray start` ran on this machine
            # (a bare ray.init() would join that cluster, and refuse the _system_config below)
            address=cfg.cluster.address or "local",
            include_dashboard=False,
            log_to_driver=True,
            logging_level="ERROR",
            configure_logging=True,
            # a Ray started here runs rlctl's actors only, each in a worker of its own (its runtime_env):
            # idle workers started ahead would be Python processes nothing uses (about 2 s of CPU)
            **({} if cfg.cluster.address else {"_system_config": LOCAL_RAY_CONFIG}),
        )
    accel = _device_resources(cfg, ray.cluster_resources())
    bundle = {k: v * per_node for k, v in {"CPU": cfg.cluster.cpus_per_rank, **accel}.items()}
    pg = placement_group([bundle] * nnodes, strategy="STRICT_SPREAD" if nnodes > 1 else "PACK")
    actors = []
    try:
        _wait_placed(pg, nnodes, per_node, bundle)
        with StopForwarder().installed() as stops:  # a stop from here on waits for each rank's trainer
            _start_actors(actors, cfg, pg, accel, nnodes * per_node, per_node)
            for a in actors:
                stops.add(ActorStop(a))
            ranks = _run_ranks(actors, rank_spec(run, cfg, plan, lease_owner), per_node, cfg.cluster.node_loss_timeout)
            return supervise(ranks, run, plan, t.total_steps, reporter, fence)
    finally:
        for a in actors:
            ray.kill(a)
        remove_placement_group(pg)
        if started_here:
            ray.shutdown()


def _run_ranks(actors: list, spec: dict[str, Any], per_node: int, timeout: float) -> list[RayRank]:
    """Start every actor's ``run`` of ``spec`` (the group's rendezvous at rank 0's node; where each rank
    runs added, for rank 0's ``ranks_placed`` event), each followed with its node (``Reach``: pings and
    Ray's account of the node, one ``NodeWatch`` for them all)."""
    import ray

    from rlctl.engine.rendezvous import user_master_port

    where = ray.get([a.node.remote() for a in actors])
    bound = ray.get(actors[0].rendezvous.remote(len(actors), user_master_port()))
    if "error" in bound:
        raise ConfigError(bound["error"])
    addr, port = where[0]["ip"], bound["port"]
    spec = {**spec, "placement": [{"rank": r, "node": w["id"], "ip": w["ip"]} for r, w in enumerate(where)]}
    watch = NodeWatch()
    return [
        RayRank(
            rank,
            a,
            a.run.remote(spec, rank, rank % per_node, per_node, addr, port),
            Reach(a, where[rank], watch, timeout),
        )
        for rank, a in enumerate(actors)
    ]


def _wait_placed(pg, nnodes: int, per_node: int, bundle: dict[str, float]) -> None:
    import ray

    ready, _ = ray.wait([pg.ready()], timeout=READY_TIMEOUT_S)
    if not ready:
        have = ray.cluster_resources()
        raise ConfigError(
            f"the Ray cluster cannot place {nnodes} x {per_node} ranks ({bundle} per node) within "
            f"{READY_TIMEOUT_S:.0f} s; it has {have}. Lower trainer.nproc / n_devices_per_node / "
            "cluster.cpus_per_rank or add nodes"
        )


def _start_actors(actors: list, cfg: RunConfig, pg, accel: dict[str, float], world: int, per_node: int) -> None:
    """Append one RankActor per rank to ``actors`` (rank r in bundle r // per_node), with the driver's
    relevant environment."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    env = {k: v for k, v in os.environ.items() if k.startswith(_PASS_ENV) or _named(k, cfg.cluster.env_vars)}
    remote = ray.remote(RankActor)
    for rank in range(world):
        actors.append(
            remote.options(
                num_cpus=cfg.cluster.cpus_per_rank,
                num_gpus=accel.get("GPU", 0),
                resources={"NPU": accel["NPU"]} if "NPU" in accel else None,
                max_concurrency=2,
                runtime_env={"env_vars": env},
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=rank // per_node),
            ).remote()
        )
