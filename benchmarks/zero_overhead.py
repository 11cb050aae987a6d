"""What DeepSpeed ZeRO costs in a world of one: forward, backward and the optimizer step of the 25.8M
Llama from grpo_vs_trl.py (hidden 512, 8 layers, MLP 1408, head_dim 64) on one CPU thread, plain
PyTorch against DeepSpeed without partitioning (ZeRO stage 0: DeepSpeed's engine and its data-parallel
allreduce around the torch optimizer), stage 0 as rlctl trains a world of one (the engine without that
allreduce, the identity over one rank: ``DSModule``), ZeRO-1 and ZeRO-2 (and ZeRO-2 with other bucket settings), all
with torch's fused AdamW and grad-norm clipping at 1.0; with --unfused, also the unfused AdamW.

    .venv/bin/python benchmarks/zero_overhead.py [--batch 32] [--seq 38] [--steps 6] [--unfused] [--stage0]

Every setup holds its own copy of the same model in this one process, and the setups take turns, one
step each, so that machine noise lands on all of them alike. Two warm-up turns; the table shows medians.
The loss is a mean log-prob of the batch, as a GRPO update's is; the batch has some left padding.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ["OMP_NUM_THREADS"] = "1"


RLCTL_STAGE0 = "ZeRO-0, no reduction (rlctl, 1 rank)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=38)
    ap.add_argument("--steps", type=int, default=6, help="measured turns per setup (after 2 warm-up turns)")
    ap.add_argument("--unfused", action="store_true", help="also plain and ZeRO-2 with the unfused AdamW")
    ap.add_argument("--stage0", action="store_true", help="only plain PyTorch and the two ZeRO-0 setups")
    args = ap.parse_args()

    import torch

    from rlctl.engine.rendezvous import init_distributed
    from rlctl.engine.runtime import setup_runtime

    rt = setup_runtime("cpu", "fp32", 1)
    init_distributed(rt.backend)
    import deepspeed
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=8,
        head_dim=64,
        max_position_embeddings=256,
    )
    setups = [
        ("plain PyTorch", None, True),
        ("ZeRO-0 (no partitioning)", {"stage": 0}, True),
        (RLCTL_STAGE0, {"stage": 0}, True),
        ("ZeRO-1", {"stage": 1}, True),
        ("ZeRO-2", {"stage": 2}, True),
        ("ZeRO-2 non-contiguous", {"stage": 2, "contiguous_gradients": False}, True),
        ("ZeRO-2 500M buckets", {"stage": 2, "reduce_bucket_size": int(5e8)}, True),
        ("ZeRO-2 overlap_comm", {"stage": 2, "overlap_comm": True}, True),
    ]
    if args.stage0:
        setups = setups[:3]
    if args.unfused:
        setups += [("plain PyTorch", None, False), ("ZeRO-2", {"stage": 2}, False)]

    torch.manual_seed(0)
    ids = torch.randint(3, 64, (args.batch, args.seq))
    mask = torch.ones_like(ids)
    mask[: args.batch // 3, :2] = 0

    def loss_of(model):
        out = model(input_ids=ids, attention_mask=mask, use_cache=False)
        return out.logits.float().log_softmax(-1)[..., 3].mean()

    steps = []
    for name, zero, fused in setups:
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg).train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=fused or None, foreach=None if fused else False)
        if zero is None:

            def step(model=model, opt=opt):
                t0 = time.perf_counter()
                loss = loss_of(model)
                t1 = time.perf_counter()
                loss.backward()
                t2 = time.perf_counter()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad()
                return t1 - t0, t2 - t1, time.perf_counter() - t2
        else:
            ds = {
                "train_micro_batch_size_per_gpu": args.batch,
                "gradient_accumulation_steps": 1,
                "gradient_clipping": 1.0,
                "zero_optimization": zero,
                "zero_allow_untested_optimizer": True,
                "steps_per_print": 2**31 - 1,
            }
            engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds)
            if name == RLCTL_STAGE0:  # (as rlctl.engine.ds_module.DSModule sets it in a world of one)
                engine.enable_backward_allreduce = False

            def step(engine=engine):
                t0 = time.perf_counter()
                loss = loss_of(engine)
                t1 = time.perf_counter()
                engine.backward(loss)
                t2 = time.perf_counter()
                engine.step()
                return t1 - t0, t2 - t1, time.perf_counter() - t2

        steps.append(step)

    times: list[list[tuple[float, float, float]]] = [[] for _ in setups]
    for turn in range(args.steps + 2):
        for i, step in enumerate(steps):
            t = step()
            if turn >= 2:
                times[i].append(t)

    print(f"25.8M Llama, batch {args.batch}x{args.seq}, one thread, median of {args.steps} alternating turns")
    print(f"{'setup':44} {'forward s':>9} {'backward s':>10} {'opt step ms':>11} {'total s':>8}")
    for (name, _, fused), ts in zip(setups, times):
        fwd, bwd, opt = (statistics.median(t[k] for t in ts) for k in range(3))
        total = statistics.median(sum(t) for t in ts)
        label = f"{name} ({'fused' if fused else 'unfused'})"
        print(f"{label:44} {fwd:9.3f} {bwd:10.3f} {opt * 1e3:11.0f} {total:8.3f}")


if __name__ == "__main__":
    main()
