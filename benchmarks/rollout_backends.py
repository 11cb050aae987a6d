"""Rollout backends compared on the same actor: hf (the lean KV-cache loop on the actor's own module)
against vllm (the in-process offline engine), plus the cost of pushing weights into vLLM.

    .venv/bin/python benchmarks/rollout_backends.py [--repeats 15] [--zero-stage 2]

For each backend: the median wall time of ``generate`` for P prompts x G samples x N new tokens (after
two warm-up calls), and for vllm the median of ``sync_weights`` (gather under ZeRO-3, hand the live
tensors to the worker's reload_weights, drop the prefix cache). One thread, one process, the built-in
tiny model unless --hidden/--layers make it bigger. Prints a table and the ratio vllm/hf.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("OMP_NUM_THREADS", "1")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--zero-stage", type=int, default=2, choices=(1, 2, 3))
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    args = ap.parse_args()

    from rlctl.config import RunConfig
    from rlctl.engine.actor import Actor
    from rlctl.engine.data import PromptCursor, load_rows
    from rlctl.engine.model import load_tokenizer, prepare_model_dir
    from rlctl.engine.rendezvous import init_distributed
    from rlctl.engine.rollout import make_backend
    from rlctl.engine.runtime import setup_runtime
    from rlctl.rundir.handle import RunDir
    from rlctl.storage import Storage

    cfg = RunConfig.model_validate(
        {
            "trainer": {"prompts_per_step": args.prompts},
            "algorithm": {"group_size": args.group},
            "rollout": {"max_new_tokens": args.new_tokens},
            "actor": {"zero_stage": args.zero_stage},
            "model": {
                "builtin": {"hidden_size": args.hidden, "num_layers": args.layers, "intermediate_size": 4 * args.hidden}
            },
        }
    )
    rt = setup_runtime("cpu", "fp32", 1)
    init_distributed(rt.backend)
    model_dir = prepare_model_dir(cfg, RunDir(Storage(tempfile.mkdtemp(prefix="rlctl-bench-"))))
    actor = Actor(cfg, model_dir, rt)
    tok = load_tokenizer(model_dir)
    rows = PromptCursor(load_rows(cfg.data, 0), 0, True).next_batch(args.prompts)
    prompts = [r["prompt"] for _, r in rows for _ in range(args.group)]
    keys = [(i, s) for i, _ in rows for s in range(args.group)]
    params = sum(p.numel() for p in actor.module.parameters())

    results = {}
    for name in ("hf", "vllm"):
        backend = make_backend(name, cfg=cfg, actor=actor, tokenizer=tok, model_dir=model_dir)
        for step in (0, 1):
            backend.generate(prompts, keys, step)
        gen = []
        for step in range(args.repeats):
            t0 = time.perf_counter()
            backend.generate(prompts, keys, 100 + step)
            gen.append(time.perf_counter() - t0)
        sync = []
        for _ in range(args.repeats if name == "vllm" else 0):
            t0 = time.perf_counter()
            backend.sync_weights()
            sync.append(time.perf_counter() - t0)
        results[name] = (statistics.median(gen), statistics.median(sync) if sync else 0.0)
        if hasattr(backend, "close"):
            backend.close()

    print(
        f"model {params / 1e6:.2f}M params, ZeRO-{args.zero_stage}, {args.prompts}x{args.group}x{args.new_tokens}, "
        f"median of {args.repeats}"
    )
    print(f"{'backend':8} {'generate ms':>12} {'sync ms':>8}")
    for name, (g, s) in results.items():
        print(f"{name:8} {g * 1e3:12.1f} {s * 1e3 if name == 'vllm' else float('nan'):8.1f}")
    print(f"vllm / hf generate time: {results['vllm'][0] / results['hf'][0]:.2f}")


if __name__ == "__main__":
    main()
