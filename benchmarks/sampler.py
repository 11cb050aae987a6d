"""The HF rollout's samplers at Qwen2.5's vocabulary, against a softmax and against transformers' own
sampling ``generate``, side by side in one run (alternating rounds, medians).

    .venv/bin/python benchmarks/sampler.py [--batch 32] [--vocab 151936] [--rounds 7] [--new-tokens 32]

1. One sampling step on (B, V) fp32 logits: the counter sampler (rollout.sampler: counter) and the
   generator sampler (rollout.sampler: generator, one CPU generator per sequence), each as its time over
   a softmax of the same logits (the unit of a step's unavoidable work).
2. A whole decode, B prompts of 16 tokens x N new tokens (no eos), on a random Qwen2-shaped model (hidden
   256, 2 layers, 2 KV heads) at that vocabulary: rlctl's ``decode`` with each sampler against
   ``model.generate(do_sample=True, top_k=0)``, as tokens/s and the ratio rlctl/transformers.
One thread, one process, the CPU (on a GPU the same script runs with --device cuda).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
STEPS = 16


def timed(fn, device: str) -> float:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def alternate(cases: dict, rounds: int, device: str) -> dict[str, float]:
    """The median seconds of each case, the cases run in turn in every round (after one warm-up each)."""
    for fn in cases.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(rounds):
        for name, fn in cases.items():
            times[name].append(timed(fn, device))
    return {name: statistics.median(t) for name, t in times.items()}


def sampler_step(args) -> dict[str, float]:
    import torch

    from rlctl.engine.rollout.hf import SeededGumbelSampler
    from rlctl.engine.rollout.noise import CounterSampler

    logits = torch.randn(args.batch, args.vocab, generator=torch.Generator().manual_seed(0)).to(args.device)
    seeds = list(range(args.batch))
    counter, generator = CounterSampler(seeds, 0.7), SeededGumbelSampler(seeds, 0.7)

    def steps(fn):  # 16 steps a round: the generator sampler draws its noise 16 tokens at a time
        return lambda: [fn() for _ in range(STEPS)]

    medians = alternate(
        {
            "softmax": steps(lambda: logits.softmax(-1)),
            "counter": steps(lambda: counter.pick(logits)),
            "generator": steps(lambda: generator.pick(logits)),
        },
        args.rounds,
        args.device,
    )
    return {name: seconds / STEPS for name, seconds in medians.items()}


def model_and_prompts(args):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=args.vocab,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).to(args.device).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    ids = torch.randint(1, args.vocab, (args.batch, 16), generator=torch.Generator().manual_seed(1)).to(args.device)
    return model, ids, torch.ones_like(ids)


def whole_decode(args) -> dict[str, float]:
    import torch

    from rlctl.engine.rollout.hf import SeededGumbelSampler, decode
    from rlctl.engine.rollout.noise import CounterSampler

    model, ids, mask = model_and_prompts(args)
    seeds, n = list(range(args.batch)), args.new_tokens

    def rlctl(kind):
        return lambda: decode(model, ids, mask, n, [], 0, kind(seeds, 1.0))

    def transformers():
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, do_sample=True, top_k=0, top_p=1.0, temperature=1.0,
                                 max_new_tokens=n, min_new_tokens=n)  # fmt: skip
        assert out.shape[1] == ids.shape[1] + n

    return alternate(
        {"counter": rlctl(CounterSampler), "generator": rlctl(SeededGumbelSampler), "transformers": transformers},
        args.rounds,
        args.device,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=151_936)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    step = sampler_step(args)
    print(f"one sampling step, B = {args.batch}, V = {args.vocab} (median of {args.rounds} rounds of {STEPS}):")
    for name in ("counter", "generator"):
        print(f"  {name:<10} {step[name] * 1e3:8.1f} ms  {step[name] / step['softmax']:6.1f}x a softmax")
    print(f"  {'softmax':<10} {step['softmax'] * 1e3:8.1f} ms")
    whole = whole_decode(args)
    tokens = args.batch * args.new_tokens
    print(f"a decode of {args.batch} x {args.new_tokens} new tokens (median of {args.rounds}):")
    for name in ("counter", "generator", "transformers"):
        ratio = whole["transformers"] / whole[name]
        print(f"  {name:<12} {tokens / whole[name]:8.1f} tokens/s  {ratio:5.2f}x transformers' generate")


if __name__ == "__main__":
    main()
