"""The actor's peak memory for one forward and backward of the log-prob loss: the full way (an fp32
(B, T, V) log-softmax kept for the backward, a second full pass for the entropy: rlctl before
``rlctl.algos.logprobs``) against the chunked way (``rlctl.engine.actor.sequence_log_probs``).

A Qwen2-shaped model with Qwen2.5's vocabulary (151,936) and two thin layers, random weights built from a
transformers config on the spot, so that the logits dominate as they do in a real actor. Each variant runs
in a fresh subprocess, which reads its peak resident memory (``ru_maxrss``) after the forward and
backward, less the peak before them (the model and the batch built): the memory the pass itself added.
Both variants print their loss and gradient norm, which must agree.

    .venv/bin/python benchmarks/actor_memory.py            # B = 2, T = 1,024, fp32, on the CPU
    .venv/bin/python benchmarks/actor_memory.py --device cuda --dtype bf16   # peak from torch.cuda
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import torch

PROMPT = 16  # prompt tokens before the response


def build(args):
    """The random Qwen2-shaped model and a (B, P + T) batch with right-padded responses."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rlctl.engine.batch import Sequences

    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=args.vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=PROMPT + args.tokens + 8,
        tie_word_embeddings=False,
    )
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    model = Qwen2ForCausalLM(cfg).to(device=args.device, dtype=dtype)
    B, T = args.batch, args.tokens
    ids = torch.randint(0, args.vocab, (B, PROMPT + T), device=args.device)
    attn = torch.ones_like(ids)
    resp = torch.ones(B, T, dtype=torch.long, device=args.device)
    resp[-1, T // 2 :] = 0  # the last response ends halfway: padding, as in a real batch
    attn[-1, PROMPT + T // 2 :] = 0
    return model, Sequences(ids, attn, resp, PROMPT)


def full_way(model, seqs, temperature: float):
    """rlctl's sequence_log_probs before the chunked one: (B, T) log-probs and entropies."""
    from rlctl import algos
    from rlctl.engine.batch import position_ids_for
    from rlctl.engine.model import logits_to_keep

    T = seqs.responses.shape[1]
    out = model(
        input_ids=seqs.input_ids,
        attention_mask=seqs.attention_mask,
        position_ids=position_ids_for(seqs.attention_mask),
        use_cache=False,
        **logits_to_keep(model, T + 1),
    )
    logits = out.logits[:, -(T + 1) : -1, :].float() / temperature
    log_probs = torch.log_softmax(logits, dim=-1)
    token_lp = log_probs.gather(-1, seqs.responses.unsqueeze(-1)).squeeze(-1)
    with torch.no_grad():
        entropy = algos.entropy_from_logits(logits.detach())
    return token_lp, entropy


def chunked_way(model, seqs, temperature: float):
    from rlctl.engine.actor import sequence_log_probs

    return sequence_log_probs(model, seqs, temperature, with_entropy=True, sampler="generator")


def peak_bytes(device: str) -> int:
    if device == "cuda":
        return torch.cuda.max_memory_allocated()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # (KiB on Linux)


def one_variant(args) -> dict:
    """Forward and backward of the log-prob loss in this process: the peak memory it added, its time,
    and its loss and gradient norm (the two variants must agree)."""
    model, seqs = build(args)
    if args.device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    before = peak_bytes(args.device)
    start = time.perf_counter()
    forward = full_way if args.variant == "full" else chunked_way
    log_prob, entropy = forward(model, seqs, 0.7)
    mask = seqs.response_mask.float()
    advantages = torch.linspace(-1, 1, log_prob.shape[1], device=log_prob.device)
    loss = -(log_prob * advantages * mask).sum() / mask.sum()
    metric = ((entropy * mask).sum() / mask.sum()).item()
    loss.backward()
    if args.device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    grad = torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None]).norm()
    return {
        "variant": args.variant,
        "peak_mib": (peak_bytes(args.device) - before) / 2**20,
        "seconds": seconds,
        "loss": loss.item(),
        "entropy": metric,
        "grad_norm": grad.item(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--variant", choices=("full", "chunked"), help="(internal: run one variant here)")
    args = parser.parse_args()
    if args.variant:
        print(json.dumps(one_variant(args)))
        return
    rows = []
    for variant in ("full", "chunked"):
        cmd = [sys.executable, __file__, "--variant", variant] + sys.argv[1:]
        rows.append(json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout))
    logits_mib = args.batch * (args.tokens + 1) * args.vocab * 4 / 2**20
    print(
        f"B={args.batch} T={args.tokens} V={args.vocab} {args.dtype} on {args.device}; "
        f"one fp32 (B, T+1, V) tensor is {logits_mib:,.0f} MiB"
    )
    print(f"{'variant':8} {'peak MiB':>9} {'seconds':>8} {'loss':>12} {'entropy':>9} {'grad norm':>11}")
    for r in rows:
        print(
            f"{r['variant']:8} {r['peak_mib']:9,.0f} {r['seconds']:8.2f} {r['loss']:12.7f} "
            f"{r['entropy']:9.5f} {r['grad_norm']:11.7f}"
        )
    print(f"ratio (full / chunked peak): {rows[0]['peak_mib'] / rows[1]['peak_mib']:.2f}x")


if __name__ == "__main__":
    main()
