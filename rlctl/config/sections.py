"""The run config's plain sections: the training loop, the model, the prompts, rollout sampling,
snapshots and the cluster. Each checks its own values only: whether a path exists or a storage
protocol is known on this machine is the preflight's question (``rlctl.preflight``), so a run's
saved config reads anywhere."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, TypeAdapter, ValidationError, field_validator, model_validator

from rlctl.config.multi_turn import MultiTurnConfig
from rlctl.config.strict import Strict


class TrainerConfig(Strict):
    total_steps: int = Field(200, ge=1, description="Number of RL steps (rollout + update) to run.")
    prompts_per_step: int = Field(
        16, ge=1, description="Prompts drawn per step; each is sampled `algorithm.group_size` times."
    )
    num_threads: int = Field(
        1, ge=1, description="torch intra-op threads on CPU (one per process avoids oversubscription)."
    )
    deterministic: bool = Field(
        False,
        description="Deterministic kernels (torch.use_deterministic_algorithms, warn-only; "
        "CUBLAS_WORKSPACE_CONFIG=:4096:8 unless set; cuDNN deterministic, no autotuning): on a GPU a resumed or "
        "rolled-back run then repeats an uninterrupted one bit for bit. Some kernels run slower; one without a "
        "deterministic version warns on stderr. The CPU is deterministic without it.",
    )
    lease_timeout: float = Field(
        120.0,
        gt=0,
        description="Seconds without a heartbeat after which another host may take the run over with --force, "
        "or a resume with --wait-for-lease once it has waited that long (a later run of the same Slurm job takes "
        "it over at once).",
    )
    lease_heartbeat: float = Field(15.0, gt=0, description="Seconds between lease heartbeats.")
    nproc: int = Field(
        1,
        ge=1,
        description="DeepSpeed ranks (data parallel) per node; `rlctl start --nproc N` sets it. "
        "Each rank generates and trains on its share of every step's prompts.",
    )
    nnodes: int = Field(1, ge=1, description="Nodes to place ranks on (cluster.backend: ray only).")
    n_devices_per_node: int | None = Field(
        None, ge=1, description="Ranks per node under Ray (empty: trainer.nproc); one device each."
    )
    val_every: int = Field(
        0,
        ge=0,
        description="Validate every N steps on the held-out prompts (`data.val_path`, or the built-in "
        "task's own held-out split), writing val/... metrics into that step's row (0: never).",
    )
    val_before_train: bool = Field(
        False, description="Also validate the initial weights before the first step (a row of step 0)."
    )
    loggers: list[Literal["tensorboard", "wandb", "mlflow"]] = Field(
        default_factory=list,
        description="Experiment trackers fed every metric row and event, besides RUN_DIR/metrics.jsonl "
        "(always written): tensorboard (RUN_DIR/tensorboard), wandb (offline unless WANDB_MODE says "
        "otherwise), mlflow (MLFLOW_TRACKING_URI, else sqlite:///RUN_DIR/mlflow.db). Each is an extra: "
        "pip install 'rlctl[tensorboard]'.",
    )

    @field_validator("loggers")
    @classmethod
    def _loggers_once(cls, v: list[str]) -> list[str]:
        twice = sorted({name for name in v if v.count(name) > 1})
        if twice:
            raise ValueError(f"{', '.join(twice)} is listed more than once")
        return v


class BuiltinModelConfig(Strict):
    arch: Literal["llama", "qwen2"] = Field("llama", description="Architecture of the built-in tiny model.")
    hidden_size: int = Field(64, ge=32, description="Hidden size of the built-in model (head_dim is 32).")
    num_layers: int = Field(2, ge=1, description="Transformer layers of the built-in model.")
    intermediate_size: int = Field(256, ge=1, description="MLP width of the built-in model.")
    tokenizer: Literal["chars", "chat"] = Field(
        "chars",
        description="The built-in model's tokenizer: chars (one token per character of a small set, no chat "
        "template) or chat (one per printable ASCII character and newline, ChatML's <|im_start|> and "
        "<|im_end|>, its eos, and a chat template that lists the tools in <tools> by name and description and "
        "wraps their answers in <tool_response>, these tags one token each: for data.apply_chat_template and "
        "rollout.multi_turn).",
    )
    added_tokens: list[str] = Field(
        default_factory=list,
        description="Texts the built-in tokenizer holds as one token each, as chat models hold <tool_call>: "
        "a whole tool call, so that a model from random weights can sample it (`rlctl start tools-demo`).",
    )

    @field_validator("hidden_size")
    @classmethod
    def _head_dim_32(cls, v: int) -> int:
        if v % 32:
            raise ValueError(f"must be a multiple of 32 (head_dim is fixed at 32), got {v}")
        return v

    @field_validator("added_tokens")
    @classmethod
    def _texts(cls, v: list[str]) -> list[str]:
        if "" in v:
            raise ValueError("an added token is an empty text")
        if twice := sorted({t for t in v if v.count(t) > 1}):
            raise ValueError(f"{', '.join(map(repr, twice))} is listed more than once")
        return v


class ModelConfig(Strict):
    path: str | None = Field(
        None,
        description="Local Hugging Face causal-LM directory. Empty: the built-in tiny model, created "
        "from `model.builtin` and saved into the run directory.",
    )
    builtin: BuiltinModelConfig = Field(
        default_factory=BuiltinModelConfig, description="Shape of the built-in tiny model."
    )
    dtype: Literal["auto", "fp32", "bf16", "fp16"] = Field(
        "auto",
        description="Training precision: auto is bf16 on CUDA and NPU devices with native bf16 "
        "(else fp32), fp32 on CPU; fp16 trains with DeepSpeed's dynamic loss scaling and fp32 master "
        "weights, for devices without bf16 (not on a CPU without oneDNN fp16).",
    )
    trust_remote_code: bool = Field(False, description="Passed to transformers' from_pretrained.")


class DataConfig(Strict):
    path: str | None = Field(
        None,
        description="JSONL or parquet file, or a `datasets` directory (save_to_disk), of prompts. "
        "Empty: the built-in synthetic task.",
    )
    val_path: str | None = Field(
        None,
        description="Held-out prompts for validation, in the same forms as `data.path`; a `data_source` "
        "column gives per-source metrics. Empty: the built-in task's held-out split (with the built-in "
        "task), else no validation data.",
    )
    builtin_val_size: int = Field(64, ge=1, description="Held-out prompts of the built-in task, never trained on.")
    prompt_key: str = Field("prompt", description="Column holding the prompt text.")
    apply_chat_template: bool = Field(
        False,
        description="Wrap each prompt as a user message (after `data.system_prompt`'s system message) with the "
        "tokenizer's chat template; on when `data.system_prompt` is set.",
    )
    system_prompt: str | None = Field(
        None,
        min_length=1,
        description="System message put before every prompt (training and validation) through the chat "
        "template; turns `data.apply_chat_template` on. Unset: none.",
    )
    max_prompt_length: int = Field(
        512,
        ge=1,
        description="Prompts longer than this many tokens (after the chat template) are truncated from the "
        "left, or dropped at load with `data.filter_overlong_prompts`.",
    )
    filter_overlong_prompts: bool = Field(
        False,
        description="Drop the prompts longer than `data.max_prompt_length` tokens once, at load (training and "
        "validation; counted in a `prompts_filtered` event), instead of truncating them.",
    )
    shuffle: bool = Field(True, description="Reshuffle the prompts every epoch (seeded, resumable).")
    builtin_size: int = Field(4096, ge=1, description="Number of prompts in the built-in task.")
    builtin_task: Literal["echo", "lookup"] = Field(
        "echo",
        description="The built-in task (without `data.path`): echo (repeat the letters before '=') or lookup "
        "(answer a word that only the `lookup` tool returns, its hidden argument: `rlctl start tools-demo`).",
    )

    @model_validator(mode="before")
    @classmethod
    def _system_prompt_templates(cls, data: Any) -> Any:
        """A system prompt is a chat message: it turns the chat template on, and contradicts it turned off."""
        if not isinstance(data, dict) or data.get("system_prompt") is None:
            return data
        try:  # read as pydantic reads a bool ("no", "off", 0 ...)
            on = TypeAdapter(bool).validate_python(data.get("apply_chat_template", True))
        except ValidationError:
            return data  # the field's own error names it
        if not on:
            raise ValueError(
                "system_prompt is set but apply_chat_template is false: a system prompt is a chat message, "
                "given through the chat template (drop apply_chat_template: false)"
            )
        return {**data, "apply_chat_template": True}


class RolloutConfig(Strict):
    backend: Literal["hf", "vllm"] = Field(
        "hf",
        description="Generation backend: hf (a lean KV-cache decode loop on the actor's own weights, "
        "no extra dependency) or vllm (vLLM's offline engine; weights pushed into it after every update).",
    )
    mode: Literal["sync", "one_step_off", "async"] = Field(
        "sync",
        description="sync: each step generates its batch, then trains on it. one_step_off: step N+1's batch is "
        "generated (by a copy of the weights step N starts from, in a background thread) while step N trains, "
        "so a batch trains one update after the weights that sampled it (rollout/staleness/mean). async: "
        "generation runs up to max_staleness steps ahead. The batches in flight are part of every snapshot "
        "(either backend: vllm shares the rank's engine).",
    )
    max_staleness: int = Field(
        1,
        ge=1,
        description="mode async: the steps generation runs ahead, so the most updates between the weights "
        "that sampled a batch and those it trains (its batches held in memory and in every snapshot).",
    )
    gpu_memory_utilization: float = Field(
        0.5, gt=0, le=1, description="vllm: fraction of device memory the engine may take (weights + KV cache)."
    )
    tensor_parallel_size: int = Field(1, ge=1, description="vllm: tensor-parallel ranks of each engine.")
    max_num_seqs: int = Field(256, ge=1, description="vllm: sequences batched together at most.")
    enforce_eager: bool = Field(False, description="vllm: no CUDA graphs (always eager on CPU).")
    cuda_graphs: bool = Field(
        False,
        description="hf backend, counter sampler, on CUDA: replay each decode step as a CUDA graph, captured once "
        "per batch-size bucket of the static KV cache (tokens and log-probs bit-identical to the eager step). "
        "Ignored on the CPU and with the generator sampler, whose decode is always eager.",
    )
    max_new_tokens: int = Field(256, ge=1, description="Longest completion, in tokens.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature.")
    sampler: Literal["counter", "generator"] = Field(
        "counter",
        description="hf backend: where the sampling noise comes from. counter: a pure function of (the "
        "sequence's seed, the token's position, the vocabulary index), computed on the device beside the "
        "logits, the same on the CPU and CUDA (docs/sampling.md). generator: one CPU generator per sequence, "
        "the only sampler before this key existed; a run's saved config without this key was started with it, and "
        "resumes with it bit for bit.",
    )
    top_p: float = Field(
        1.0,
        gt=0,
        le=1,
        description="Nucleus sampling: keep the most probable tokens whose mass first reaches top_p (1: off).",
    )
    top_k: int = Field(
        0, ge=-1, description="Keep the top_k most probable tokens, ties included (0 as vLLM, or -1 as verl: off)."
    )
    min_p: float = Field(
        0.0, ge=0, le=1, description="Drop tokens less probable than min_p times the most probable one (0: off)."
    )
    stop: list[str] = Field(
        default_factory=list,
        description="Stop strings: a completion ends at the first one, which its text leaves out (its tokens "
        "stay, like an eos); nothing after it is part of the response.",
    )
    val_temperature: float = Field(
        0.0, ge=0, description="Sampling temperature of validation (0: greedy, one answer per prompt)."
    )
    val_samples: int = Field(
        1,
        ge=1,
        description="Completions per validation prompt (val/score/mean@N and best@N); more than 1 needs "
        "val_temperature > 0.",
    )

    multi_turn: MultiTurnConfig | None = Field(
        None,
        description="Conversations in which the model calls tools between its turns (hf backend; needs "
        "data.apply_chat_template). Empty: one completion per prompt.",
    )

    @model_validator(mode="after")
    def _greedy_is_one(self) -> RolloutConfig:
        if self.val_samples > 1 and self.val_temperature == 0:
            raise ValueError("val_samples > 1 needs val_temperature > 0 (greedy decoding gives one answer)")
        return self

    @model_validator(mode="after")
    def _multi_turn_fits(self) -> RolloutConfig:
        mt = self.multi_turn
        if mt is None:
            return self
        if mt.max_total_tokens < self.max_new_tokens:
            raise ValueError(
                f"multi_turn.max_total_tokens ({mt.max_total_tokens}) must be at least max_new_tokens "
                f"({self.max_new_tokens}): the model's tokens are part of it"
            )
        return self

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, v: list[str]) -> list[str]:
        if any(not s for s in v):
            raise ValueError("a stop string cannot be empty")
        return v

    def truncates(self) -> bool:
        """Whether top_p, top_k or min_p cut the sampling distribution (all off: plain softmax(logits / T))."""
        return self.top_p < 1 or self.top_k > 0 or self.min_p > 0


class KeepBestConfig(Strict):
    """Which snapshots retention keeps as the best."""

    metric: str = Field(
        "val/score/mean",
        min_length=1,
        description="The validation metric (val/...) that ranks snapshots: their manifests record those.",
    )
    mode: Literal["max", "min"] = Field("max", description="max: higher is better; min: lower is better.")
    k: int = Field(1, ge=1, description="How many of the best snapshots retention keeps.")

    @field_validator("metric")
    @classmethod
    def _a_validation_metric(cls, v: str) -> str:
        if not v.startswith("val/"):
            raise ValueError(f"snapshots record validation metrics only (val/...), got {v!r}")
        return v


class CheckpointConfig(Strict):
    every: int = Field(
        0,
        ge=0,
        description="Snapshot every N steps (0: only on preemption); a run with snapshots also "
        "snapshots its last step.",
    )
    dir: str | None = Field(
        None,
        description="Where snapshots go, any fsspec URL (s3://, gs://, memory://, a path). Empty: RUN_DIR/checkpoints.",
    )
    storage_options: dict[str, Any] = Field(
        default_factory=dict,
        description="fsspec options for the snapshot storage, e.g. {client_kwargs: {endpoint_url: ...}}.",
    )
    keep_last: int | None = Field(
        3, ge=1, description="Keep the newest N snapshots (empty: keep all). The newest good one is always kept."
    )
    keep_every: int = Field(0, ge=0, description="Also keep snapshots whose step is a multiple of this (0: off).")
    keep_best: KeepBestConfig | None = Field(
        None,
        description="Also keep the k good snapshots with the best value of a validation metric, e.g. "
        "{metric: val/score/mean, mode: max, k: 2}; `--from best` and `--step best` pick the first.",
    )
    asynchronous: bool = Field(
        True, description="Write, upload and commit in the background; training waits only for staging."
    )
    writer: Literal["process", "thread"] = Field(
        "process",
        description="process: snapshot files are serialized, hashed, written and uploaded by a writer "
        "process of each rank (off the training process's GIL; its state is handed over in shared memory); "
        "thread: by a thread of the training process. memory:// storage always uses the thread.",
    )
    staging_dir: str | None = Field(
        None, description="Local directory for staging snapshots bound for remote storage (default: temp)."
    )
    max_failures: int = Field(
        3,
        ge=1,
        description="End the run with exit 12 after this many consecutive failed snapshots (a failed "
        "final snapshot always ends it so).",
    )
    retry_timeout: float = Field(
        120.0,
        ge=0,
        description="Seconds a transient storage failure (an unreachable or throttling object store, a "
        "reset connection) is retried with backoff before it counts as failed; 0: no retries.",
    )


class ClusterConfig(Strict):
    backend: Literal["local", "ray"] = Field(
        "local",
        description="local: ranks are processes on this machine; ray: ranks (and their process "
        "group) are Ray actors placed by a placement group over trainer.nnodes x trainer.n_devices_per_node.",
    )
    address: str | None = Field(
        None, description="ray: address of a running cluster (`--ray-address`); empty: start a local Ray."
    )
    cpus_per_rank: float = Field(1.0, gt=0, description="ray: CPUs reserved for each rank's actor.")
    node_loss_timeout: float = Field(
        60.0,
        gt=0,
        description="ray: seconds a rank's actor may go without answering the driver's pings (sent every 2 s) "
        "before its node is declared lost, when Ray has not declared it dead first (by its own health checks, "
        "about 15 s by default). The driver then stops the other ranks and exits 76.",
    )
    env_vars: list[str] = Field(
        default_factory=list,
        description="ray: more of the driver's environment variables handed to the ranks (a name, or a prefix "
        "ending in *), e.g. what a tool or reward function reads (an API key, a service's address). Besides "
        "these, the ranks get rlctl's own (RLCTL_*, HF_*, AWS_*, FSSPEC_*, ...); the rest of theirs is their "
        "node's.",
    )
