"""Snapshot cost against the disk it lands on, measured in one run, for both snapshot writers.

    .venv/bin/python benchmarks/checkpoint.py [--dir DIR] [--hidden 768 --layers 12] [--repeats 3]

Builds a real DeepSpeed ZeRO-2 actor (a ~134M-parameter Llama-style model with AdamW states, about
2.15 GB of snapshot), takes one optimizer step so the Adam moments exist, takes one snapshot with the
writer process (it starts, and the state moves into shared memory: a one-time cost, printed), then
measures on the same disk, alternating, medians over --repeats:

- raw: sequential write of the same number of bytes with one fsync (the issue's baseline), and the same
  write paced as the snapshot's files are (writeback started after every 64 MiB): the disk's ceiling.
  The snapshot, paced, beats the first; sha256 of as many bytes on one core (every file is hashed as it
  is written) bounds it below the second;
- for each writer (``thread``: a thread of the training process; ``process``: the rank's writer
  process): a synchronous snapshot (serialize, hash, fsync, manifest: what a synchronous save costs
  training), and the asynchronous stall: the extra wall time of [snapshot + the next training update]
  over the update alone. The update waits at a fence before its optimizer step until the writer no
  longer reads the live state, and competes with the writer for the CPU meanwhile: both are in the stall;
- the floor: the same update while a bare niced process writes the same bytes with one fsync. On a
  machine whose CPUs both train and write, this is what any writer beside training costs it;
- memory: the same update while a bare niced process makes 3 in-memory passes over as many bytes (no
  disk): the memory traffic of a writer reading the state (the staging copy, serializing, hashing),
  against an optimizer step that streams the same amount.

It prints each writer's stall as a fraction of its synchronous save (target <= 5%) and its snapshot
bandwidth as a fraction of raw (target >= 80%), and the floor as a fraction of the synchronous save.
Then an in-process rollback of the same state, by a real Trainer of the model whose KL policy fires
(the ``metric`` drill): the time from the firing to the next step against the pure load of the
snapshot it rolls back to (target <= 1.5x).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch


def raw_write(path: str, nbytes: int, chunk: int = 64 << 20, paced: bool = False) -> float:
    """Seconds to write ``nbytes`` sequentially and fsync once. ``paced``: also ask the kernel to start
    writeback after every 64 MiB chunk (``sync_file_range``), as the snapshot's files do."""
    from rlctl.checkpoint.durable import _SYNC_FILE_RANGE_WRITE, _sync_file_range

    buf = os.urandom(chunk)
    t0 = time.perf_counter()
    with open(path, "wb") as fh:
        left, done = nbytes, 0
        while left > 0:
            n = min(chunk, left)
            fh.write(buf[:n])
            left, done = left - n, done + n
            if paced and _sync_file_range is not None:
                fh.flush()
                _sync_file_range(fh.fileno(), done - n, n, _SYNC_FILE_RANGE_WRITE)
        fh.flush()
        os.fsync(fh.fileno())
    dt = time.perf_counter() - t0
    os.unlink(path)
    return dt


_RAW_WRITER = """
import os, sys
os.nice(10)
path, left, chunk = sys.argv[1], int(sys.argv[2]), 64 << 20
buf = os.urandom(chunk)
print("ready", flush=True)
with open(path, "wb") as fh:
    while left > 0:
        left -= fh.write(buf[: min(chunk, left)])
    fh.flush()
    os.fsync(fh.fileno())
os.unlink(path)
"""


_MEMORY_PASSES = """
import os, sys
os.nice(10)
n, passes, chunk = int(sys.argv[1]), int(sys.argv[2]), 64 << 20
src, dst = bytearray(os.urandom(chunk)) * (n // chunk + 1), bytearray(n + chunk)
print("ready", flush=True)
s, d = memoryview(src), memoryview(dst)
for _ in range(passes):
    for off in range(0, n, chunk):
        d[off : off + chunk] = s[off : off + chunk]
"""


def beside_memory_passes(nbytes: int, passes: int, work) -> float:
    """Seconds ``work()`` takes while a niced process copies ``nbytes`` in memory ``passes`` times, no
    disk: the memory traffic a writer makes reading the state (a staging copy, serializing, hashing)."""
    args = [sys.executable, "-c", _MEMORY_PASSES, str(nbytes), str(passes)]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True)
    proc.stdout.readline()
    seconds = work()
    proc.wait()
    return seconds


def sha256_alone(nbytes: int, chunk: int = 64 << 20) -> float:
    """Seconds one core takes to sha256 ``nbytes`` in memory (every snapshot file is hashed as it is
    written: this bounds a writer's bandwidth from above, whatever the disk)."""
    buf, digest = os.urandom(chunk), hashlib.sha256()
    t0 = time.perf_counter()
    for off in range(0, nbytes, chunk):
        digest.update(buf[: min(chunk, nbytes - off)])
    return time.perf_counter() - t0


def beside_raw_write(path: str, nbytes: int, work) -> float:
    """Seconds ``work()`` takes while a niced process writes ``nbytes`` to ``path`` with one fsync: what
    any writer beside training costs it on this machine (the floor of the stall)."""
    proc = subprocess.Popen([sys.executable, "-c", _RAW_WRITER, path, str(nbytes)], stdout=subprocess.PIPE, text=True)
    proc.stdout.readline()  # it is writing now
    seconds = work()
    proc.wait()
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir under the repo's disk)")
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    from transformers import LlamaConfig, LlamaForCausalLM

    from rlctl.checkpoint.snapshots import SnapshotManager
    from rlctl.config import RunConfig
    from rlctl.engine.actor import Actor, Sequences
    from rlctl.engine.model import build_char_tokenizer
    from rlctl.engine.rendezvous import init_distributed
    from rlctl.engine.runtime import setup_runtime
    from rlctl.storage import Storage

    root = Path(args.dir or tempfile.mkdtemp(prefix="rlctl-bench-", dir=Path(__file__).resolve().parents[1]))
    root.mkdir(parents=True, exist_ok=True)
    try:
        runtime = setup_runtime("cpu", "fp32", 1)
        init_distributed(runtime.backend)
        model_dir = root / "model"
        cfg_model = LlamaConfig(
            vocab_size=args.vocab,
            hidden_size=args.hidden,
            intermediate_size=args.hidden * 8 // 3,
            num_hidden_layers=args.layers,
            num_attention_heads=args.hidden // 64,
            num_key_value_heads=args.hidden // 64,
            max_position_embeddings=128,
        )
        LlamaForCausalLM(cfg_model).save_pretrained(model_dir)
        build_char_tokenizer().save_pretrained(model_dir)
        cfg = RunConfig.model_validate(
            {
                "model": {"path": str(model_dir)},
                "actor": {"zero_stage": 2, "lr": 1e-5},
                "trainer": {"prompts_per_step": 1},
                "algorithm": {"group_size": 2},
            }
        )
        actor = Actor(cfg, model_dir, runtime)
        n_params = sum(p.numel() for p in actor.module.parameters())
        ids = torch.randint(0, args.vocab, (2, 24))
        seqs = Sequences(ids, torch.ones_like(ids), torch.ones(2, 16, dtype=torch.long), prompt_len=8)
        actor.update(seqs, torch.randn(2, 16), None, None, 0.0)  # Adam moments now exist

        class Counters:
            def state_dict(self):
                return {"version": 1, "step": 1}

            def load_state_dict(self, state):
                pass

        def timed_update() -> float:
            t0 = time.perf_counter()
            actor.update(seqs, torch.randn(2, 16), None, None, 0.0)
            return time.perf_counter() - t0

        def sync_snapshot(tag: str, writer: str) -> tuple[float, int]:
            manager = SnapshotManager(Storage(str(root / f"ckpt-{tag}")), asynchronous=False, writer=writer)
            t0 = time.perf_counter()
            manager.save(1, {"trainer": Counters()}, {"actor": actor}, good=True)
            total = time.perf_counter() - t0
            size = manager.catalog.scan()[0].manifest["total_bytes"]
            manager.close()
            shutil.rmtree(manager.storage.path())
            return total, size

        def async_stall(tag: str, writer: str) -> tuple[float, float, float]:
            manager = SnapshotManager(Storage(str(root / f"ckpt-{tag}")), writer=writer)
            waited = []

            def fence() -> None:
                t = time.perf_counter()
                manager.wait_staged()
                waited.append(time.perf_counter() - t)

            actor.fence = fence
            t0 = time.perf_counter()
            manager.save(1, {"trainer": Counters()}, {"actor": actor}, good=True)
            save_s = time.perf_counter() - t0
            actor.update(seqs, torch.randn(2, 16), None, None, 0.0)
            blocked = time.perf_counter() - t0
            assert manager.wait(), "the asynchronous snapshot did not commit"
            manager.close()
            actor.fence = None
            shutil.rmtree(manager.storage.path())
            return blocked, save_s, sum(waited)

        first, size = sync_snapshot("first", "process")  # starts the writer; the state moves to shared memory
        print(
            f"first snapshot with the writer process (start it, move {size / 1e9:.2f} GB of state into shared "
            f"memory): {first:.2f} s",
            flush=True,
        )
        timed_update()  # warm-up
        rows: dict[str, list[float]] = {}
        for i in range(args.repeats):
            rows.setdefault("update", []).append(timed_update())
            rows.setdefault("raw", []).append(raw_write(str(root / "raw.bin"), size))
            rows.setdefault("raw paced", []).append(raw_write(str(root / "raw.bin"), size, paced=True))
            rows.setdefault("sha256", []).append(sha256_alone(size))
            rows.setdefault("beside raw", []).append(beside_raw_write(str(root / "raw2.bin"), size, timed_update))
            rows.setdefault("beside memory", []).append(beside_memory_passes(size, 3, timed_update))
            for writer in ("thread", "process"):
                rows.setdefault(f"sync {writer}", []).append(sync_snapshot(f"s{writer}{i}", writer)[0])
                blocked, save_s, waited = async_stall(f"a{writer}{i}", writer)
                rows.setdefault(f"blocked {writer}", []).append(blocked)
                rows.setdefault(f"save {writer}", []).append(save_s)
                rows.setdefault(f"fence {writer}", []).append(waited)
        report(rows, size, n_params, root, args.repeats)
        rollback_at_scale(model_dir, root)
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)


def rollback_at_scale(model_dir: Path, root: Path) -> None:
    """An in-process rollback of this state: a real Trainer of the same model (2 prompts x 2 samples x 8
    new tokens, snapshots every 2 steps with the writer process) whose KL policy fires at steps 4 and 8
    (the ``metric`` drill) and rolls back to the snapshot two steps back, committed by then; the time
    from each firing to the next step against the pure load of that snapshot (``overheads.py`` does
    the same on the tiny model, also with the target still in flight)."""
    from overheads import Events, build, print_rollbacks, rollback_overrides, time_rollbacks

    fire_at = [4, 8]
    workload = ["trainer.prompts_per_step=2", "algorithm.group_size=2", "rollout.max_new_tokens=8"]
    workload += [f"model.path={model_dir}", "actor.zero_stage=2"]
    events = Events()
    trainer = build(str(root / "rollback"), rollback_overrides(fire_at), events, workload)
    figures = time_rollbacks(trainer, events, fire_at, loads=3)
    print_rollbacks(figures, "in-process rollback of this state to a committed snapshot (process writer)", "s")


def report(rows: dict[str, list[float]], size: int, n_params: int, root: Path, repeats: int) -> None:
    med = {k: statistics.median(v) for k, v in rows.items()}
    gb, raw, update = size / 1e9, med["raw"], med["update"]
    print(
        f"model: {n_params / 1e6:.0f}M parameters, ZeRO-2, fp32 with AdamW; snapshot {gb:.2f} GB; "
        f"disk: {root}; median of {repeats}"
    )
    print(f"{'measure':<48}{'seconds':>10}{'GB/s':>8}")
    paced = med["raw paced"]
    print(f"{'raw sequential write + fsync':<48}{raw:>10.3f}{gb / raw:>8.2f}")
    print(f"{'raw, writeback started every 64 MiB, + fsync':<48}{paced:>10.3f}{gb / paced:>8.2f}")
    print(f"{'sha256 of as many bytes, one core, in memory':<48}{med['sha256']:>10.3f}{gb / med['sha256']:>8.2f}")
    print(f"{'training update alone':<48}{update:>10.3f}")
    print(f"{'the update beside a raw write in a niced process':<48}{med['beside raw']:>10.3f}")
    for w in ("thread", "process"):
        print(f"{f'[{w}] synchronous snapshot':<48}{med[f'sync {w}']:>10.3f}{gb / med[f'sync {w}']:>8.2f}")
        print(f"{f'[{w}] async: save() returns after':<48}{med[f'save {w}']:>10.3f}")
        print(f"{f'[{w}] async snapshot + the next update':<48}{med[f'blocked {w}']:>10.3f}")
        print(f"{f'[{w}]   of which waiting at the fence':<48}{med[f'fence {w}']:>10.3f}")
    print(f"{'the update beside 3 niced in-memory passes':<48}{med['beside memory']:>10.3f}")
    floor = max(0.0, med["beside raw"] - update)
    print(f"floor: a bare write beside training slows it {floor:.3f} s = {floor / med['sync process']:6.1%} of a save")
    memory = max(0.0, med["beside memory"] - update)
    print(
        f"memory: 3 bare passes over the state's bytes beside training slow it {memory:.3f} s = "
        f"{memory / med['sync process']:6.1%} of a save"
    )
    for w in ("thread", "process"):
        stall, sync = max(0.0, med[f"blocked {w}"] - update), med[f"sync {w}"]
        print(f"[{w:>7}] stall {stall:.3f} s / synchronous save = {stall / sync:6.1%}   (target <= 5%)")
        print(f"[{w:>7}] snapshot bandwidth / raw write     = {raw / sync:6.1%}   (target >= 80%)")
        print(f"[{w:>7}] snapshot bandwidth / paced raw write = {paced / sync:6.1%}")


if __name__ == "__main__":
    sys.exit(main())
