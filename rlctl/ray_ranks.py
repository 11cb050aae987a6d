"""Ranks as Ray actors (``cluster.backend: ray``).

A placement group reserves ``trainer.nnodes`` bundles, one per node (STRICT_SPREAD over several nodes,
PACK on one), each holding ``trainer.n_devices_per_node`` ranks: ``cluster.cpus_per_rank`` CPUs and,
on CUDA, one GPU per rank (a custom ``NPU`` resource on Ascend). Rank 0's actor publishes its node
address and a free port; every actor then joins one torch.distributed group (gloo on CPU, NCCL on
CUDA, HCCL on NPU) and runs ``rank_main`` to the end. Actors are threaded (two calls at once) so the
driver can forward a stop while a rank trains.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

from rlctl.storage import Storage
from rlctl.config import RunConfig
from rlctl.errors import ConfigError
from rlctl.launch import GRACE_S, _Follower, _spec, _start_step, free_port, outcome, rank_main, starts_grace

READY_TIMEOUT_S = 120.0
_PASS_ENV = ("RLCTL_", "HF_", "TRANSFORMERS_", "TORCH_EXTENSIONS_DIR", "TOKENIZERS_", "TORCH_DEVICE_BACKEND_AUTOLOAD",
             "FSSPEC_", "AWS_", "GOOGLE_", "GCSFS_")  # fmt: skip


class RankActor:
    def node_ip(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def free_port(self) -> int:
        return free_port()

    def run(self, spec: dict[str, Any], rank: int, local_rank: int, local_world: int, addr: str, port: int) -> dict:
        return rank_main(spec, rank, local_rank, local_world, addr, port)

    def stop(self, reason: str) -> None:
        from rlctl.run import request_stop

        request_stop(reason)


def _device_resources(cfg: RunConfig, cluster: dict[str, float]) -> dict[str, float]:
    """Accelerators each rank reserves: a GPU on CUDA, an NPU (custom resource) on Ascend. With
    device: auto the cluster's resources decide (the driver may be a CPU-only head node)."""
    if cfg.device == "cuda" or (cfg.device == "auto" and cluster.get("GPU", 0) > 0):
        return {"GPU": 1.0}
    if cfg.device == "npu" or (cfg.device == "auto" and cluster.get("NPU", 0) > 0):
        return {"NPU": 1.0}
    return {}


def launch_ray(run: Storage, cfg: RunConfig, restore: dict | None, reporter) -> dict[str, Any]:
    try:
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
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
        ray.init(address=cfg.cluster.address, include_dashboard=False, log_to_driver=True,
                 logging_level="ERROR", configure_logging=True)  # fmt: skip
    accel = _device_resources(cfg, ray.cluster_resources())
    per_rank = {"CPU": cfg.cluster.cpus_per_rank, **accel}
    bundle = {k: v * per_node for k, v in per_rank.items()}
    pg = placement_group([bundle] * nnodes, strategy="STRICT_SPREAD" if nnodes > 1 else "PACK")
    actors, refs = [], []
    previous: dict = {}
    try:
        ready, _ = ray.wait([pg.ready()], timeout=READY_TIMEOUT_S)
        if not ready:
            have = ray.cluster_resources()
            raise ConfigError(
                f"the Ray cluster cannot place {nnodes} x {per_node} ranks ({bundle} per node) within "
                f"{READY_TIMEOUT_S:.0f} s; it has {have}. Lower trainer.nproc / n_devices_per_node / "
                "cluster.cpus_per_rank or add nodes"
            )
        env = {k: v for k, v in os.environ.items() if k.startswith(_PASS_ENV)}
        remote = ray.remote(RankActor)
        for rank in range(nnodes * per_node):
            actors.append(remote.options(
                num_cpus=cfg.cluster.cpus_per_rank, num_gpus=accel.get("GPU", 0),
                resources={"NPU": accel["NPU"]} if "NPU" in accel else None, max_concurrency=2,
                runtime_env={"env_vars": env},
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=rank // per_node),
            ).remote())  # fmt: skip
        addr, port = ray.get([actors[0].node_ip.remote(), actors[0].free_port.remote()])
        spec = _spec(run, cfg, restore)
        refs = [a.run.remote(spec, rank, rank % per_node, per_node, addr, port) for rank, a in enumerate(actors)]

        def forward(signum, _frame):
            for a in actors:
                a.stop.remote(signal.Signals(signum).name)

        previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGUSR1)}
        follower = _Follower(run, reporter)
        follower.poll(force=True)
        reporter.ready(_start_step(restore), t.total_steps)
        results: list[dict | None] = [None] * len(refs)
        pending = dict(enumerate(refs))
        failed_first, failed_at = None, None
        while pending:
            done, _ = ray.wait(list(pending.values()), num_returns=1, timeout=0.2)
            follower.poll()
            for ref in done:
                rank = next(r for r, x in pending.items() if x == ref)
                del pending[rank]
                try:
                    results[rank] = ray.get(ref)
                except Exception as exc:  # the rank crashed: a bug, or its process died
                    results[rank] = {"code": 1, "message": f"rank {rank} crashed: {type(exc).__name__}: "
                                     f"{str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}", "summary": None}  # fmt: skip
                if failed_first is None and starts_grace(results[rank]["code"]):
                    failed_first, failed_at = rank, time.monotonic()
            if failed_at is not None and pending and time.monotonic() - failed_at > GRACE_S:
                for rank in list(pending):  # the others would wait in a collective forever
                    ray.kill(actors[rank])
                    results[rank] = None
                    del pending[rank]
        follower.poll(force=True)
        return outcome(results, failed_first)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for a in actors:
            ray.kill(a)
        remove_placement_group(pg)
        if started_here:
            ray.shutdown()
