"""What DeepSpeed ZeRO costs in a world of one: forward + backward and the optimizer step of the 25.8M
Llama from grpo_vs_trl.py (hidden 512, 8 layers, MLP 1408, head_dim 64), plain PyTorch against ZeRO-1
and ZeRO-2, with torch's fused AdamW (and, with --unfused, the unfused one) on one CPU thread.

    .venv/bin/python benchmarks/zero_overhead.py [--batch 32] [--seq 50] [--steps 5] [--unfused]

Each configuration runs in its own process; the first two steps are warm-up, the table shows medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def worker(stage: int, batch: int, seq: int, steps: int, fused: bool) -> dict:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    from rlctl.engine.runtime import init_distributed, setup_runtime

    rt = setup_runtime("cpu", "fp32", 1)
    init_distributed(rt.backend)
    import deepspeed
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                      num_attention_heads=8, num_key_value_heads=8, head_dim=64, max_position_embeddings=256)  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=fused or None, foreach=None if fused else False)
    x = torch.randint(0, 64, (batch, seq))
    if stage < 0:
        def step():
            t0 = time.perf_counter()
            model(input_ids=x, labels=x).loss.backward()
            t1 = time.perf_counter()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            return t1 - t0, time.perf_counter() - t1
    else:
        ds = {"train_micro_batch_size_per_gpu": batch, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
              "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
              "steps_per_print": 2**31 - 1}  # fmt: skip
        engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds)

        def step():
            t0 = time.perf_counter()
            engine.backward(engine(input_ids=x, labels=x).loss)
            t1 = time.perf_counter()
            engine.step()
            return t1 - t0, time.perf_counter() - t1
    times = [step() for _ in range(steps)][2:]
    return {"fwd_bwd": statistics.median(a for a, _ in times), "opt": statistics.median(b for _, b in times)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=50)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--unfused", action="store_true", help="also measure the unfused AdamW")
    ap.add_argument("--worker", type=str, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        stage, fused = json.loads(args.worker)
        print(json.dumps(worker(stage, args.batch, args.seq, args.steps, fused)))
        return
    print(f"25.8M Llama, batch {args.batch}x{args.seq}, one thread, median of {args.steps - 2} steps")
    print(f"{'setup':24} {'fwd+bwd s':>10} {'opt step ms':>12}")
    for fused in (True, False) if args.unfused else (True,):
        for stage, name in ((-1, "plain PyTorch"), (1, "ZeRO-1"), (2, "ZeRO-2")):
            cmd = [sys.executable, __file__, "--batch", str(args.batch), "--seq", str(args.seq), "--steps",
                   str(args.steps), "--worker", json.dumps([stage, fused])]  # fmt: skip
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
            r = json.loads(out)
            label = f"{name} ({'fused' if fused else 'unfused'})"
            print(f"{label:24} {r['fwd_bwd']:10.2f} {r['opt'] * 1e3:12.0f}")


if __name__ == "__main__":
    main()
