"""Snapshot cost against the disk it lands on, measured in one run.

    .venv/bin/python benchmarks/checkpoint.py [--dir DIR] [--hidden 768 --layers 12] [--repeats 3]

Builds a real DeepSpeed ZeRO-2 actor (a ~130M-parameter Llama-style model with AdamW states, about
1.6 GB of state), takes one optimizer step so the Adam moments exist, then measures on the same disk:

- raw: sequential write of the same number of bytes with one fsync (the disk's ceiling);
- sync: a snapshot with the background commit disabled (serialize, hash, fsync, manifest), i.e. what a
  synchronous save costs training;
- async stall: the extra wall time of [snapshot + the next training update] over the same update
  without a snapshot. Snapshot files are serialized in a background thread straight from the live
  tensors; the update waits at a fence before its optimizer step if they are not written yet, and
  competes with the writer for the CPU meanwhile. Both costs are in the stall.

It prints the stall as a fraction of the synchronous save (target <= 5%) and the snapshot bandwidth as a
fraction of raw (target >= 80%). Medians over --repeats.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch


def raw_write(path: str, nbytes: int, chunk: int = 64 << 20) -> float:
    buf = os.urandom(chunk)
    t0 = time.perf_counter()
    with open(path, "wb") as fh:
        left = nbytes
        while left > 0:
            n = min(chunk, left)
            fh.write(buf[:n])
            left -= n
        fh.flush()
        os.fsync(fh.fileno())
    dt = time.perf_counter() - t0
    os.unlink(path)
    return dt


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
    from rlctl.engine.runtime import init_distributed, setup_runtime
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

        def sync_snapshot(tag: str) -> tuple[float, int]:
            manager = SnapshotManager(Storage(str(root / f"ckpt-{tag}")), asynchronous=False)
            t0 = time.perf_counter()
            manager.save(1, {"trainer": Counters()}, {"actor": actor}, good=True)
            total = time.perf_counter() - t0
            size = manager.scan()[0].manifest["total_bytes"]
            manager.close()
            shutil.rmtree(manager.storage.path())
            return total, size

        def async_stall(tag: str) -> tuple[float, float]:
            manager = SnapshotManager(Storage(str(root / f"ckpt-{tag}")))

            def fence() -> None:
                t = time.perf_counter()
                manager.wait_staged()
                rows["fence"].append(time.perf_counter() - t)

            actor.fence = fence
            t0 = time.perf_counter()
            manager.save(1, {"trainer": Counters()}, {"actor": actor}, good=True)
            save_s = time.perf_counter() - t0
            actor.update(seqs, torch.randn(2, 16), None, None, 0.0)
            blocked = time.perf_counter() - t0
            manager.close()
            actor.fence = None
            shutil.rmtree(manager.storage.path())
            return blocked, save_s

        rows = {"raw": [], "sync": [], "blocked": [], "save": [], "update": [], "fence": []}
        size = 0
        timed_update()  # warm-up
        for i in range(args.repeats):
            rows["update"].append(timed_update())
            sync_s, size = sync_snapshot(f"s{i}")
            rows["sync"].append(sync_s)
            blocked, save_s = async_stall(f"a{i}")
            rows["blocked"].append(blocked)
            rows["save"].append(save_s)
            rows["raw"].append(raw_write(str(root / "raw.bin"), size))
        raw, sync, blocked, save_s, update = (
            statistics.median(rows[k]) for k in ("raw", "sync", "blocked", "save", "update")
        )
        stall = max(0.0, blocked - update)
        gb = size / 1e9
        print(
            f"model: {n_params / 1e6:.0f}M parameters, ZeRO-2, fp32 with AdamW; snapshot {gb:.2f} GB; "
            f"disk: {root}; median of {args.repeats}"
        )
        print(f"{'measure':<44}{'seconds':>10}{'GB/s':>8}")
        print(f"{'raw sequential write + fsync':<44}{raw:>10.3f}{gb / raw:>8.2f}")
        print(f"{'synchronous snapshot':<44}{sync:>10.3f}{gb / sync:>8.2f}")
        print(f"{'training update alone':<44}{update:>10.3f}")
        print(f"{'async snapshot: save() returns after':<44}{save_s:>10.3f}")
        print(f"{'async snapshot + the next update':<44}{blocked:>10.3f}")
        print(f"{'  of which waiting at the fence':<44}{statistics.median(rows['fence']):>10.3f}")
        print(f"{'async snapshot: training stall':<44}{stall:>10.3f}")
        print(f"stall / synchronous save       = {stall / sync:6.1%}   (target <= 5%)")
        print(f"snapshot bandwidth / raw write = {raw / sync:6.1%}   (target >= 80%)")
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
