"""Checks 3 and 4, on check 2's model in this process.

3, the decode probe: rlctl's HF rollout decode (``rlctl.engine.rollout.hf.decode`` with the counter
sampler new runs use) against transformers' own sampling ``generate(do_sample=True)`` and, where the
installed transformers has it, its continuous batching (``generate_batch``), on the same model, prompts
and shape, full-vocabulary sampling at temperature 1 for all three: tokens per second of each, in rounds
whose order alternates, after a short warm-up of each; the rounds stop when the next would not fit the
budget (the figures keep the rounds that ran).

4, the CPU/GPU identity of the counter sampler: the model's logits for a batch, a decode step at a time,
picked on the device and, copied, on the CPU by a fresh sampler each with the same seeds, plain and with
top-p, top-k and min-p: the tokens must be equal at every step (the dry run compares the CPU with itself).
"""

from __future__ import annotations

import statistics
import time

from gpucheck.context import Ctx
from gpucheck.report import Clock, Fail, Skip

SEED = 1234
PAGE = 256  # tokens per page of transformers' paged cache (continuous batching)


def prompts(ctx: Ctx, batch: int, length: int):
    """(batch, length) random token ids of the trained tokenizer's ordinary tokens (no padding), seeded."""
    import torch

    g = torch.Generator().manual_seed(SEED)
    low = len(ctx.tokenizer.all_special_ids)
    ids = torch.randint(low, len(ctx.tokenizer), (batch, length), generator=g)
    return ids.to(ctx.device), torch.ones_like(ids).to(ctx.device)


def synchronize(ctx: Ctx) -> None:
    import torch

    if ctx.device == "cuda":
        torch.cuda.synchronize()


class Methods:
    """The three ways to sample ``new`` tokens after the same prompts: each returns the tokens it made
    (up to and including each row's eos, the same count rlctl's response mask gives)."""

    def __init__(self, ctx: Ctx, ids, mask):
        self.ctx, self.ids, self.mask = ctx, ids, mask
        tok = ctx.tokenizer
        self.eos, self.pad = tok.eos_token_id, tok.pad_token_id
        self.seeds = [SEED + i for i in range(ids.shape[0])]

    def rlctl(self, new: int) -> int:
        from rlctl.engine.rollout.hf import decode, response_mask_for
        from rlctl.engine.rollout.noise import CounterSampler

        sampler = CounterSampler(self.seeds, 1.0)
        responses, _, _ = decode(self.ctx.model, self.ids, self.mask, new, [self.eos], self.pad, sampler)
        return int(response_mask_for(responses, [self.eos]).sum())

    def rlctl_graphs(self, new: int) -> int:
        """rlctl with rollout.cuda_graphs (each bucket's step captured, then replayed; ignored on the CPU)."""
        from rlctl.engine.rollout.hf import decode, response_mask_for
        from rlctl.engine.rollout.noise import CounterSampler

        sampler = CounterSampler(self.seeds, 1.0)
        responses, _, _ = decode(
            self.ctx.model, self.ids, self.mask, new, [self.eos], self.pad, sampler, cuda_graphs=True
        )
        return int(response_mask_for(responses, [self.eos]).sum())

    def generate(self, new: int) -> int:
        from rlctl.engine.rollout.hf import response_mask_for

        out = self.ctx.model.generate(
            input_ids=self.ids,
            attention_mask=self.mask,
            do_sample=True,
            max_new_tokens=new,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            eos_token_id=self.eos,
            pad_token_id=self.pad,
        )
        return int(response_mask_for(out[:, self.ids.shape[1] :], [self.eos]).sum())

    def generate_batch(self, new: int) -> int:
        """transformers' continuous batching, its paged cache sized to this work (by default it takes most
        of the free memory: on the CPU, the machine's), its manager kept between calls, as a server keeps
        it (``close`` lets it go)."""
        import inspect

        from transformers import GenerationConfig

        config = GenerationConfig(
            do_sample=True,
            max_new_tokens=new,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            eos_token_id=self.eos,
            pad_token_id=self.pad,
        )
        batch, length = self.ids.shape
        sizes = {"num_blocks": -(-batch * (length + new) // PAGE) + batch, "max_batch_tokens": batch * length}
        accepts = inspect.signature(self.ctx.model.generate_batch).parameters
        kwargs = {"persistent_manager": True, "warmup": self.ctx.device == "cuda"}
        kwargs = {k: v for k, v in kwargs.items() if k in accepts}
        if "continuous_batching_config" in accepts:
            from transformers.generation.configuration_utils import ContinuousBatchingConfig

            kwargs["continuous_batching_config"] = ContinuousBatchingConfig(page_size=PAGE, **sizes)
        else:  # older versions read the cache's sizes from the generation config
            config.update(block_size=PAGE, **sizes)
        outputs = self.ctx.model.generate_batch(inputs=self.ids.tolist(), generation_config=config, **kwargs)
        errors = [o.error for o in outputs.values() if o.error]
        if errors:
            raise RuntimeError(f"{len(errors)} requests failed: {errors[0]}")
        return sum(len(o.generated_tokens) for o in outputs.values())

    def close(self) -> None:
        destroy = getattr(self.ctx.model, "destroy_cached_continuous_batching_manager", None)
        if destroy is not None:
            destroy()


def timed(ctx: Ctx, fn, new: int) -> dict:
    synchronize(ctx)
    t = time.perf_counter()
    tokens = fn(new)
    synchronize(ctx)
    took = time.perf_counter() - t
    return {"seconds": round(took, 4), "tokens": tokens, "tokens_per_s": round(tokens / took, 1)}


def check_probe(ctx: Ctx, fig: dict, clock: Clock) -> None:
    if ctx.model is None:
        raise Skip("no model: check 2 did not build one")
    shape = ctx.size.probe
    batch, new = shape["batch"], shape["new_tokens"]
    fig["shape"] = dict(shape)
    fig["sampling"] = "temperature 1, the whole vocabulary (top_k 0, top_p 1) in all three"
    methods = Methods(ctx, *prompts(ctx, batch, shape["prompt"]))
    names = ["rlctl", "generate", "rlctl_graphs"]
    names += ["generate_batch"] if hasattr(ctx.model, "generate_batch") else []
    fig["methods"] = {n: {"warmup": None, "rounds": [], "error": None} for n in names}
    if "generate_batch" not in names:
        fig["generate_batch"] = "this transformers has no generate_batch (continuous batching)"
    found, first, later = fig["methods"], {n: fig["methods"][n] for n in names[:2]}, names[2:]
    try:  # rlctl and generate warmed up and measured once before generate_batch's warm-up (CUDA graphs)
        warmup(ctx, methods, first, clock, min(8, new))
        stopped = measure_rounds(ctx, methods, first, clock, new, range(1))
        warmup(ctx, methods, {n: found[n] for n in later}, clock, min(8, new))
        stopped |= measure_rounds(ctx, methods, found, clock, new, range(1, shape["rounds"]))
        fig["stopped_at_budget"] = stopped
    finally:
        methods.close()
    rate = {n: median_rate(m) for n, m in fig["methods"].items()}
    fig["tokens_per_s"] = rate
    fig["rlctl_over"] = {
        n: round(rate["rlctl"] / rate[n], 3) for n in names[1:] if rate.get(n) and rate.get("rlctl") is not None
    }
    if rate.get("rlctl_graphs") and rate.get("generate"):  # (the target: 2x generate with CUDA graphs)
        fig["rlctl_graphs_over_generate"] = round(rate["rlctl_graphs"] / rate["generate"], 3)
    fig["summary"] = probe_summary(fig, rate, batch, new)
    for name in ("rlctl", "generate"):
        if fig["methods"][name]["error"]:
            raise Fail(f"{name} failed: {fig['methods'][name]['error']}")
    if not fig["methods"]["rlctl"]["rounds"] or not fig["methods"]["generate"]["rounds"]:
        raise Fail("the budget ran out before a measured round of rlctl and of generate")


def warmup(ctx: Ctx, methods: Methods, found: dict, clock: Clock, new: int) -> None:
    """Two short calls of each: the first chooses kernels, compiles (rlctl's sampler under torch.compile on
    CUDA) and makes caches (``first_call_s``), the second's time estimates a full round's; generate_batch's
    only while 40% of the budget is left (it may capture CUDA graphs first)."""
    for name in found:
        if name == "generate_batch" and clock.left() < 0.4 * clock.seconds:
            found[name]["error"] = "not warmed up: less than 40% of the budget left"
            continue
        try:
            first = timed(ctx, getattr(methods, name), new)["seconds"]
            found[name]["warmup"] = {**timed(ctx, getattr(methods, name), new), "new_tokens": new}
            found[name]["warmup"]["first_call_s"] = first
        except Exception as exc:  # one method's failure is its figure; the others still run
            found[name]["error"] = f"{type(exc).__name__}: {exc}"


def measure_rounds(ctx: Ctx, methods: Methods, found: dict, clock: Clock, new: int, rounds: range) -> bool:
    """These rounds of every method that warmed up, the order alternating from round to round; a call is
    left out when its estimate (its last round, else its warm-up scaled to ``new`` tokens, with half
    again) does not fit the budget. Whether any was left out."""
    live = [n for n in found if found[n]["error"] is None and found[n]["warmup"] is not None]
    stopped = False
    for r in rounds:
        for name in live if r % 2 == 0 else live[::-1]:
            m = found[name]
            last = (
                m["rounds"][-1]["seconds"] if m["rounds"] else m["warmup"]["seconds"] * new / m["warmup"]["new_tokens"]
            )
            if found[name]["error"] is not None or not clock.fits(1.5 * last):
                stopped = True
                continue
            try:
                m["rounds"].append(timed(ctx, getattr(methods, name), new))
            except Exception as exc:
                m["error"] = f"{type(exc).__name__}: {exc}"
    return stopped


def median_rate(m: dict) -> float | None:
    rates = [r["tokens_per_s"] for r in m["rounds"]]
    return round(statistics.median(rates), 1) if rates else None


def probe_summary(fig: dict, rate: dict, batch: int, new: int) -> str:
    parts = [f"{n} {r:.0f}" if r else f"{n} -" for n, r in rate.items()]
    ratios = ", ".join(f"rlctl/{n} {v}x" for n, v in fig["rlctl_over"].items())
    rounds = "/".join(str(len(m["rounds"])) for m in fig["methods"].values())
    cut = " (stopped at its budget)" if fig["stopped_at_budget"] else ""
    return f"{batch} x {new} tokens, tokens/s: {', '.join(parts)}; {ratios}; rounds {rounds}{cut}"


# -- 4: CPU/GPU identity ----------------------------------------------------------------------------------
FILTERS = {
    "plain": dict(temperature=1.0),
    "top_k": dict(temperature=0.7, top_k=50),
    "top_p_min_p": dict(temperature=0.7, top_p=0.9, min_p=0.05),
}
# reported, not judged: top_p's cumulative sums and min_p's softmax may round differently on the two
# devices at a token on the cut (docs/sampling.md promises the identity with them off)
REPORTED_ONLY = {"top_p_min_p"}


def check_identity(ctx: Ctx, fig: dict, clock: Clock) -> None:
    if ctx.model is None:
        raise Skip("no model: check 2 did not build one")
    try:
        from rlctl.engine.rollout.noise import CounterSampler  # noqa: F401
    except ImportError as exc:
        raise Skip(f"rlctl has no counter sampler here ({exc})") from None
    shape = ctx.size.identity
    fig["compared"] = f"{ctx.device} against cpu" if ctx.device != "cpu" else "cpu against cpu (the dry run has no GPU)"
    fig["shape"] = dict(shape)
    fig["runs"] = {}
    for name, settings in FILTERS.items():
        if not clock.fits(2):
            fig["runs"][name] = {"stopped_at_budget": True}
            continue
        fig["runs"][name] = {**settings, **compare_devices(ctx, shape, settings, clock)}
    runs = [r for name, r in fig["runs"].items() if name not in REPORTED_ONLY]
    differing = sum(r.get("tokens_differing", 0) for r in runs)
    steps = sum(r.get("steps", 0) for r in runs)
    fig["summary"] = f"{fig['compared']}: {differing} of {steps * shape['batch']} tokens differ over {steps} steps"
    if differing:
        raise Fail(f"{differing} tokens differ between {fig['compared']}")
    if not steps:
        raise Fail("the budget ran out before a step was compared")


def compare_devices(ctx: Ctx, shape: dict, settings: dict, clock: Clock) -> dict:
    """Decode ``shape['steps']`` tokens with the device's picks, picking each step's logits on both
    devices; the tokens differing (each step), the first step that differs, the largest difference of
    the scaled logits."""
    import torch
    from transformers import DynamicCache

    from rlctl.engine.rollout.noise import CounterSampler

    ids, mask = prompts(ctx, shape["batch"], shape["prompt"])
    seeds = [SEED + 7 * i for i in range(shape["batch"])]
    temperature = settings["temperature"]
    filters = {k: v for k, v in settings.items() if k != "temperature"}
    here, cpu = CounterSampler(seeds, temperature, **filters), CounterSampler(seeds, temperature, **filters)
    cache, differing, first, largest, steps = DynamicCache(), 0, None, 0.0, 0
    with torch.no_grad():
        out = ctx.model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)
        for step in range(shape["steps"]):
            logits = out.logits[:, -1, :]
            tokens, scaled = here.pick(logits)
            tokens_cpu, scaled_cpu = cpu.pick(logits.to("cpu", copy=True))
            wrong = int((tokens.cpu() != tokens_cpu).sum())
            differing += wrong
            first = step if wrong and first is None else first
            largest = max(largest, float((scaled.cpu() - scaled_cpu).abs().max()))
            steps += 1
            if not clock.fits(1):
                break
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            out = ctx.model(input_ids=tokens[:, None], attention_mask=mask, past_key_values=cache, use_cache=True)
    return {"steps": steps, "tokens_differing": differing, "first_differing_step": first, "scaled_max_abs": largest}
