"""The run config's schema: ``RunConfig`` and its sections, strict pydantic models.

Every field carries a description (a test checks it), so ``rlctl start --help`` and the README can be
generated from one place. The choices of the RL maths (advantage estimators, KL estimators, loss
aggregation modes, importance-ratio levels, KL controllers) are the names of the registries in
``rlctl.algos.registry``, never a second list. Loading files and ``--set`` is ``load``'s job.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import fsspec
import yaml
from fsspec.core import split_protocol
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from rlctl.algos.registry import (
    ADVANTAGES,
    AGG_MODES,
    GROUP_ESTIMATORS,
    KL_CONTROLLERS,
    KL_ESTIMATORS,
    POLICY_LOSS_LEVELS,
)
from rlctl.config.knob_values import KnobKey, ScheduleConfig, domain, in_domain, lift_schedules, may_exceed, set_knob
from rlctl.errors import ConfigError
from rlctl.faults import parse as parse_faults
from rlctl.policies.schema import PolicySpec


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class TrainerConfig(Strict):
    total_steps: int = Field(200, ge=1, description="Number of RL steps (rollout + update) to run.")
    prompts_per_step: int = Field(
        16, ge=1, description="Prompts drawn per step; each is sampled `algorithm.group_size` times."
    )
    num_threads: int = Field(
        1, ge=1, description="torch intra-op threads on CPU (one per process avoids oversubscription)."
    )
    lease_timeout: float = Field(
        120.0,
        gt=0,
        description="Seconds without a heartbeat after which another host may take the run over with --force.",
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

    @field_validator("hidden_size")
    @classmethod
    def _head_dim_32(cls, v: int) -> int:
        if v % 32:
            raise ValueError(f"must be a multiple of 32 (head_dim is fixed at 32), got {v}")
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

    @field_validator("path")
    @classmethod
    def _path_exists(cls, v: str | None) -> str | None:
        if v is not None and not Path(v).expanduser().is_dir():
            raise ValueError(f"no such model directory: {v}")
        return v


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

    @field_validator("path", "val_path")
    @classmethod
    def _data_exists(cls, v: str | None) -> str | None:
        if v is None:
            return v
        p = Path(v).expanduser()
        if p.is_dir():
            if not (p / "dataset_info.json").is_file() and not (p / "dataset_dict.json").is_file():
                raise ValueError(f"{v} is a directory but not a `datasets` directory (save_to_disk)")
            return v
        if not p.is_file():
            raise ValueError(f"no such file: {v}")
        if p.suffix not in (".jsonl", ".json", ".parquet"):
            raise ValueError(f"expected a .jsonl or .parquet file, got {p.name}")
        return v


DEFAULT_REWARD = "rlctl.engine.reward.builtin:echo_reward"
REWARD_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-")


def _check_reward_function(v: str) -> str:
    """``module:function``, else a ValueError."""
    module, sep, fn = v.partition(":")
    if not sep or not module or not fn:
        raise ValueError(f"expected 'module:function', got {v!r}")
    return v


def _check_reward_url(v: str) -> str:
    """An http:// or https:// URL with a host, else a ValueError (it is not contacted here)."""
    parts = urlsplit(v)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"expected an http:// or https:// URL with a host, got {v!r}")
    return v


class RewardModelConfig(Strict):
    path: str = Field(
        description="Local Hugging Face sequence-classification model directory (num_labels 1) with its tokenizer."
    )
    dtype: Literal["auto", "fp32", "bf16"] = Field(
        "auto", description="Precision of the reward model: auto is bf16 on CUDA and NPU with native bf16, else fp32."
    )
    batch_size: int = Field(16, ge=1, description="Completions scored per forward pass (per rank).")

    @field_validator("path")
    @classmethod
    def _path_exists(cls, v: str) -> str:
        if not Path(v).expanduser().is_dir():
            raise ValueError(f"no such model directory: {v}")
        return v


class RewardSourceConfig(Strict):
    function: str | None = Field(
        None, description="Reward function as `module:function` (exactly one of function, url and model)."
    )
    url: str | None = Field(
        None, description='HTTP(S) endpoint POSTed the batch as JSON, answering {"scores": [...]} (one of three).'
    )
    model: RewardModelConfig | None = Field(
        None, description="A sequence-classification reward model scoring prompt + completion (one of three)."
    )
    kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Extra keyword arguments (a URL receives them as the body's `kwargs`)."
    )
    weight: float = Field(1.0, allow_inf_nan=False, description="Weight of this source in the step's summed score.")
    name: str | None = Field(
        None,
        description="Name in `critic/score/<name>/mean`; default: the function's name, the URL's host or the "
        "model directory's name.",
    )
    timeout: float = Field(30.0, gt=0, description="URL only: seconds to wait for one request's answer.")
    retries: int = Field(
        3, ge=0, description="URL only: retries (exponential backoff) on connection errors, timeouts, 5xx and 429."
    )

    @field_validator("function")
    @classmethod
    def _module_function(cls, v: str | None) -> str | None:
        return None if v is None else _check_reward_function(v)

    @field_validator("url")
    @classmethod
    def _http_url(cls, v: str | None) -> str | None:
        return None if v is None else _check_reward_url(v)

    @field_validator("name")
    @classmethod
    def _metric_name(cls, v: str | None) -> str | None:
        if v is not None and not (v and set(v) <= REWARD_NAME_CHARS):
            raise ValueError(f"expected letters, digits, '_', '.' or '-' (it becomes a metric name), got {v!r}")
        return v

    @model_validator(mode="after")
    def _one_kind(self) -> RewardSourceConfig:
        if [self.function, self.url, self.model].count(None) != 2:
            raise ValueError("give exactly one of 'function', 'url' and 'model'")
        if self.model is not None and self.kwargs:
            raise ValueError("'kwargs' apply to a 'function' or 'url' source, not to a 'model'")
        if self.url is None and (self.timeout != 30.0 or self.retries != 3):  # (defaults: a resolved config)
            raise ValueError("'timeout' and 'retries' apply to a 'url' source only")
        return self

    @property
    def label(self) -> str:
        """The source's name: its own, else the function's name or the URL's host."""
        if self.name is not None:
            return self.name
        if self.function is not None:
            return self.function.partition(":")[2]
        if self.model is not None:
            name = "".join(c if c in REWARD_NAME_CHARS else "_" for c in Path(self.model.path).expanduser().name)
            return name or "model"
        return urlsplit(self.url).hostname or "url"


class RewardConfig(Strict):
    function: str = Field(
        DEFAULT_REWARD,
        description="Reward function as `module:function`, called as "
        "fn(prompts, completions, **columns) -> list[float] (single-source shorthand).",
    )
    kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Extra keyword arguments for `function` (or sent to `url`)."
    )
    url: str | None = Field(
        None, description="HTTP(S) reward endpoint (single-source shorthand): POSTed the batch, answers scores."
    )
    timeout: float = Field(30.0, gt=0, description="With `url`: seconds to wait for one request's answer.")
    retries: int = Field(
        3, ge=0, description="With `url`: retries (exponential backoff) on connection errors, timeouts, 5xx and 429."
    )
    model: RewardModelConfig | None = Field(
        None,
        description="A sequence-classification reward model scoring prompt + completion (single-source shorthand).",
    )
    sources: list[RewardSourceConfig] | None = Field(
        None, description="Weighted reward sources, summed; each source's mean is logged as critic/score/<name>/mean."
    )

    @field_validator("function")
    @classmethod
    def _module_function(cls, v: str) -> str:
        return _check_reward_function(v)

    @field_validator("url")
    @classmethod
    def _http_url(cls, v: str | None) -> str | None:
        return None if v is None else _check_reward_url(v)

    @model_validator(mode="after")
    def _one_form(self) -> RewardConfig:
        # told apart from the defaults, not by what a file names: a resolved config (RUN_DIR/config.yaml)
        # writes every key, defaults included, and must load again
        function = self.function != DEFAULT_REWARD
        if self.sources is not None:
            clash = (["function"] if function else []) + (["url"] if self.url is not None else [])
            clash += (["model"] if self.model is not None else []) + (["kwargs"] if self.kwargs else [])
            if clash:
                raise ValueError(f"give either 'sources' or {' and '.join(map(repr, clash))}, not both")
            if not self.sources:
                raise ValueError("'sources' is empty: give at least one source")
            names = [s.label for s in self.sources]
            if dupes := sorted({n for n in names if names.count(n) > 1}):
                raise ValueError(
                    f"source names must be unique (repeated: {', '.join(dupes)}); set 'name' to tell them apart"
                )
        elif sum((function, self.url is not None, self.model is not None)) > 1:
            given = [k for k, on in (("function", function), ("url", self.url), ("model", self.model)) if on]
            raise ValueError(f"give one of {' and '.join(map(repr, given))}, not both (or list them under 'sources')")
        elif self.model is not None and self.kwargs:
            raise ValueError("'kwargs' apply to 'function' or 'url', not to 'model'")
        if self.url is None and (self.timeout != 30.0 or self.retries != 3):
            raise ValueError("'timeout' and 'retries' apply with 'url' only (a URL source has its own)")
        return self

    def source_list(self) -> list[RewardSourceConfig]:
        """The sources to score with: ``sources``, or the one that ``url``, ``model`` or ``function`` names."""
        if self.sources is not None:
            return list(self.sources)
        if self.url is not None:
            return [RewardSourceConfig(url=self.url, kwargs=self.kwargs, timeout=self.timeout, retries=self.retries)]
        if self.model is not None:
            return [RewardSourceConfig(model=self.model)]
        return [RewardSourceConfig(function=self.function, kwargs=self.kwargs)]


AdvEstimator = Literal[ADVANTAGES.names]
KLEstimator = Literal[KL_ESTIMATORS.names]
LossAggMode = Literal[AGG_MODES.names]
PolicyLossLevel = Literal[POLICY_LOSS_LEVELS.names]
KLControllerType = Literal[KL_CONTROLLERS.names]


class KLControllerConfig(Strict):
    type: KLControllerType = Field(
        "fixed", description="fixed: kl_coef stays; adaptive: it moves toward target_kl (Ziegler et al.)."
    )
    target_kl: float = Field(0.1, gt=0, description="Adaptive controller: the KL it steers toward.")
    horizon: int = Field(10000, ge=1, description="Adaptive controller: samples over which it adapts.")


class DynamicSamplingConfig(Strict):
    enabled: bool = Field(
        False, description="DAPO: drop groups whose rewards all tie and sample more prompts to refill the batch."
    )
    max_gen_batches: int = Field(
        4, ge=1, description="Most generation rounds per step when refilling (then train on what there is)."
    )


class OverlongConfig(Strict):
    enabled: bool = Field(False, description="DAPO's soft overlong punishment added to the reward.")
    buffer_len: int = Field(
        4, ge=1, description="Tokens before rollout.max_new_tokens where the penalty ramps from 0 to -factor."
    )
    penalty_factor: float = Field(1.0, ge=0, description="The penalty at and beyond rollout.max_new_tokens.")


class AlgorithmConfig(Strict):
    name: Literal["grpo", "ppo"] = Field(
        "grpo", description="grpo: critic-free (group baselines); ppo: a critic model and GAE."
    )
    adv_estimator: AdvEstimator | None = Field(
        None,
        description="Advantage estimator: grpo, drgrpo, rloo, reinforce_plus_plus, "
        "reinforce_plus_plus_baseline, gae. Empty: grpo for name grpo, gae for name ppo.",
    )
    group_size: int = Field(8, ge=1, description="Completions sampled per prompt (GRPO's G).")
    kl_coef: float = Field(
        0.0, ge=0, description="Weight of the KL against the frozen reference model (0: no reference)."
    )
    kl_estimator: KLEstimator = Field(
        "k3", description="KL estimator: k1 (log-ratio), k2 (squared), k3 (verl's low_var_kl, clamped)."
    )
    kl_in_reward: bool = Field(
        False, description="Fold the KL penalty into the per-token reward instead of adding a KL loss."
    )
    kl_ctrl: KLControllerConfig = Field(
        default_factory=KLControllerConfig, description="The KL coefficient's controller."
    )
    clip_ratio: float = Field(0.2, gt=0, lt=1, description="PPO clip range epsilon for the ratio.")
    clip_ratio_low: float | None = Field(None, gt=0, lt=1, description="Lower clip epsilon (empty: clip_ratio).")
    clip_ratio_high: float | None = Field(
        None, gt=0, description="Upper clip epsilon; above clip_ratio_low is DAPO's clip-higher (empty: clip_ratio)."
    )
    clip_ratio_c: float | None = Field(
        3.0, gt=1, description="Dual-clip bound for negative advantages, as verl (empty: no dual clip)."
    )
    importance_ratio: PolicyLossLevel = Field(
        "token", description="token: PPO's per-token ratio; sequence: GSPO's sequence-level ratio."
    )
    loss_agg_mode: LossAggMode = Field("token-mean", description="How per-token losses become one number.")
    entropy_coef: float = Field(0.0, ge=0, description="Entropy bonus weight (subtracted from the loss).")
    gamma: float = Field(1.0, gt=0, le=1, description="Discount (GAE, REINFORCE++).")
    lam: float = Field(1.0, ge=0, le=1, description="GAE lambda.")
    ppo_epochs: int = Field(1, ge=1, description="Passes of updates over each rollout batch.")
    adv_eps: float = Field(1e-6, gt=0, description="Added to the group std when normalising advantages.")
    dynamic_sampling: DynamicSamplingConfig = Field(
        default_factory=DynamicSamplingConfig, description="DAPO's dynamic sampling."
    )
    overlong: OverlongConfig = Field(default_factory=OverlongConfig, description="DAPO's overlong penalty.")

    @property
    def estimator(self) -> str:
        return self.adv_estimator or ("gae" if self.name == "ppo" else "grpo")

    @property
    def clip_low(self) -> float:
        return self.clip_ratio_low if self.clip_ratio_low is not None else self.clip_ratio

    @property
    def clip_high(self) -> float:
        return self.clip_ratio_high if self.clip_ratio_high is not None else self.clip_ratio

    def idle_knob(self, key: str) -> str | None:
        """Why the knob ``key`` does nothing under this algorithm, in words that end a sentence; None
        when it acts: a critic setting without a critic, target_kl without the adaptive controller."""
        if key.startswith("critic.") and self.name != "ppo":
            return f"algorithm.name is {self.name}, which has no critic (the critic settings apply to ppo)"
        if key == "algorithm.kl_ctrl.target_kl" and self.kl_ctrl.type != "adaptive":
            return f"algorithm.kl_ctrl.type is {self.kl_ctrl.type} (target_kl steers the adaptive controller only)"
        return None

    @model_validator(mode="after")
    def _consistent(self) -> AlgorithmConfig:
        est = self.estimator
        if (est == "gae") != (self.name == "ppo"):
            raise ValueError("adv_estimator gae needs a critic (name: ppo), and ppo uses gae")
        if est in GROUP_ESTIMATORS and self.group_size < 2:
            raise ValueError(f"adv_estimator {est} compares samples of a prompt: group_size must be at least 2")
        return self


class LoraSettings(Strict):
    rank: int = Field(0, ge=0, description="LoRA rank r of the actor's adapter (peft); 0: no LoRA, full fine-tuning.")
    alpha: float = Field(16.0, gt=0, description="LoRA alpha: the adapter's update is scaled by alpha / rank.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapter's input (peft's lora_dropout).")
    target_modules: Literal["all-linear"] | list[str] = Field(
        "all-linear",
        description="Modules that get an adapter: all-linear (every linear layer but the output head) or a list "
        "of module names (e.g. [q_proj, v_proj]), each of which must name a module of the model.",
    )

    @field_validator("target_modules")
    @classmethod
    def _some_targets(cls, v):
        if isinstance(v, list) and not v:
            raise ValueError("must name at least one module, or be all-linear")
        return v


class ActorConfig(Strict):
    lora: LoraSettings = Field(
        default_factory=LoraSettings,
        description="LoRA through peft: rank > 0 trains only an adapter on the frozen base; the reference "
        "model is the base with the adapter disabled.",
    )
    gradient_checkpointing: bool = Field(
        False, description="Recompute the actor's activations in the backward pass (less memory, more compute)."
    )
    lr: float = Field(1e-6, gt=0, description="AdamW learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas.")
    warmup_steps: int = Field(0, ge=0, description="Linear lr warm-up, in optimizer steps.")
    zero_stage: Literal[1, 2, 3] = Field(2, description="DeepSpeed ZeRO stage of the actor.")
    grad_clip: float = Field(1.0, gt=0, description="Clip the global gradient norm to this value.")
    mini_batch_size: int | None = Field(
        None,
        ge=1,
        description="Sequences per optimizer step, over all ranks; empty: the whole rollout batch (one step "
        "per epoch).",
    )
    micro_batch_size: int | None = Field(
        None,
        ge=1,
        description="Sequences per forward/backward on each rank, accumulated to the rank's share "
        "of a mini-batch; empty: that whole share.",
    )
    max_tokens_per_micro_batch: int | None = Field(
        None,
        ge=1,
        description="Dynamic batching (verl's use_dynamic_bsz, ppo_max_token_len_per_gpu): each rank's share "
        "of a mini-batch sorted by length and cut into micro-batches of at most this many padded tokens "
        "(rows x (longest prompt + longest response)), for the actor's and critic's updates and their "
        "no-grad passes; the loss stays the exact mini-batch mean. Empty: by micro_batch_size.",
    )

    @model_validator(mode="after")
    def _one_way_to_cut(self) -> ActorConfig:
        if self.micro_batch_size is not None and self.max_tokens_per_micro_batch is not None:
            raise ValueError(
                "set actor.micro_batch_size or actor.max_tokens_per_micro_batch, not both: they are two "
                "ways to cut a mini-batch into micro-batches"
            )
        return self


class CriticConfig(Strict):
    path: str | None = Field(
        None, description="Value model initialisation (a causal-LM directory); empty: the actor's model."
    )
    lr: float = Field(1e-5, gt=0, description="Critic AdamW learning rate.")
    zero_stage: Literal[1, 2, 3] = Field(2, description="DeepSpeed ZeRO stage of the critic.")
    grad_clip: float = Field(1.0, gt=0, description="Clip the critic's gradient norm to this value.")
    cliprange_value: float = Field(0.5, gt=0, description="Value clipping range around the old values.")
    warmup_steps: int = Field(0, ge=0, description="Steps that train only the critic before the actor starts.")
    gradient_checkpointing: bool = Field(
        False, description="Recompute the critic's activations in the backward pass (less memory, more compute)."
    )


class RolloutConfig(Strict):
    backend: Literal["hf", "vllm"] = Field(
        "hf",
        description="Generation backend: hf (a lean KV-cache decode loop on the actor's own weights, "
        "no extra dependency) or vllm (vLLM's offline engine; weights pushed into it after every update).",
    )
    gpu_memory_utilization: float = Field(
        0.5, gt=0, le=1, description="vllm: fraction of device memory the engine may take (weights + KV cache)."
    )
    tensor_parallel_size: int = Field(1, ge=1, description="vllm: tensor-parallel ranks of each engine.")
    max_num_seqs: int = Field(256, ge=1, description="vllm: sequences batched together at most.")
    enforce_eager: bool = Field(False, description="vllm: no CUDA graphs (always eager on CPU).")
    max_new_tokens: int = Field(256, ge=1, description="Longest completion, in tokens.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature.")
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

    @model_validator(mode="after")
    def _greedy_is_one(self) -> RolloutConfig:
        if self.val_samples > 1 and self.val_temperature == 0:
            raise ValueError("val_samples > 1 needs val_temperature > 0 (greedy decoding gives one answer)")
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

    @field_validator("dir")
    @classmethod
    def _known_protocol(cls, v: str | None) -> str | None:
        if v is not None:
            check_protocol(v)
        return v


def check_protocol(url: str) -> None:
    """ValueError naming the protocols nearest to an unknown one of ``url`` (``s4://b``, or any link of
    a chained ``simplecache::s3://b``). Only fsspec's registry is read: nothing is imported."""
    for part in url.split("::"):
        protocol = split_protocol(part)[0]
        known = fsspec.available_protocols()
        if protocol is not None and protocol not in known:
            close = difflib.get_close_matches(protocol, known, n=3, cutoff=0.5)
            hint = f"; did you mean {' or '.join(f'{c}://' for c in close)}?" if close else ""
            raise ValueError(f"unknown storage protocol '{protocol}://' in {url!r}{hint}")


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


_RENDERED: tuple[str, str] = ("", "")  # the last config rendered as YAML: (the repr of its values, its YAML)


class RunConfig(Strict):
    name: str = Field("run", description="Run name; the default run directory is runs/<name>-<timestamp>.")
    seed: int = Field(
        0, ge=0, le=2**63 - 1, description="Seed of everything: model init, data order, sampling (0 to 2^63-1)."
    )
    device: Literal["auto", "cpu", "cuda", "npu"] = Field(
        "auto", description="auto: CUDA when present, else an Ascend NPU (torch_npu) when present, else CPU."
    )
    cluster: ClusterConfig = Field(default_factory=ClusterConfig, description="Where the ranks run.")
    trainer: TrainerConfig = Field(default_factory=TrainerConfig, description="The training loop.")
    model: ModelConfig = Field(default_factory=ModelConfig, description="The policy model.")
    data: DataConfig = Field(default_factory=DataConfig, description="The prompts.")
    reward: RewardConfig = Field(default_factory=RewardConfig, description="The reward function.")
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig, description="The RL algorithm.")
    actor: ActorConfig = Field(default_factory=ActorConfig, description="The trained policy (DeepSpeed).")
    critic: CriticConfig = Field(default_factory=CriticConfig, description="The value model (algorithm.name: ppo).")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="Generation of completions.")
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig, description="Snapshots.")
    faults: str | None = Field(
        None,
        description="Fault drills this run arms, as in RLCTL_FAULTS (e.g. nan_log_prob@120: a NaN at step 120 "
        "that a rollback policy must recover from); the environment variable adds to them. For drills and demos.",
    )
    policies: list[PolicySpec] = Field(
        default_factory=list,
        description="Rollback policies checked after every step: paths to YAML files (see policies/) or "
        "inline policies. The resolved config holds them inline.",
    )
    schedules: dict[KnobKey, ScheduleConfig] = Field(
        default_factory=dict,
        description="Knobs whose value follows the step, e.g. {algorithm.kl_coef: {schedule: [{until: 0.2, value: "
        "0.0}, {value: 0.001}]}}; a knob may also be written so at its own place (it is moved here). The knob's "
        "field holds its value at the current step; policy adjustments compose with it (scale, offset, min, max).",
    )

    @model_validator(mode="before")
    @classmethod
    def _lift_schedules(cls, data: Any) -> Any:
        return lift_schedules(data)

    @field_validator("schedules")
    @classmethod
    def _schedule_values_legal(cls, v: dict[str, ScheduleConfig], info: ValidationInfo) -> dict[str, ScheduleConfig]:
        """Every entry's value is legal for its knob, and every scheduled knob acts in this run."""
        algorithm = info.data.get("algorithm")
        for key, sched in v.items():
            if algorithm is not None and (idle := algorithm.idle_knob(key)) is not None:
                raise ValueError(f"{key} has a schedule, but {idle}: it would do nothing")
            legal = domain(RunConfig, key)
            for i, entry in enumerate(sched.schedule):
                if not legal.contains(entry.value):
                    raise ValueError(
                        f"{key}: the value of entry {i} ({entry.value:g}) is not a legal {key} ({legal.describe()})"
                    )
        return v

    @model_validator(mode="after")
    def _schedules_fit(self) -> RunConfig:
        """A scheduled KL coefficient has no adaptive controller; ``kl_in_reward`` needs a coefficient
        that is (or is scheduled to become) above 0; a scheduled knob not written as a number takes
        its value at step 0."""
        if "algorithm.kl_coef" in self.schedules and self.algorithm.kl_ctrl.type == "adaptive":
            raise ValueError(
                "algorithm.kl_coef has a schedule, but algorithm.kl_ctrl.type is adaptive (the controller moves "
                "the coefficient): use one or the other"
            )
        if self.algorithm.kl_in_reward and not may_exceed(self, "algorithm.kl_coef", 0.0):
            raise ValueError("algorithm.kl_in_reward needs algorithm.kl_coef > 0 (or a schedule that rises above 0)")
        for key, sched in self.schedules.items():
            *parents, name = key.split(".")
            node = self
            for part in parents:
                node = getattr(node, part)
            if name not in node.model_fields_set:
                set_knob(self, key, in_domain(self, key, sched.value_at(0, self.trainer.total_steps))[0])
        return self

    @field_validator("faults")
    @classmethod
    def _faults_parse(cls, v: str | None) -> str | None:
        if v is not None:
            try:
                parse_faults(v)
            except ConfigError as exc:  # its sentence, located by the config loader
                raise ValueError(exc.message) from None
        return v

    @property
    def world_size(self) -> int:
        """DeepSpeed ranks: trainer.nproc locally; nnodes x n_devices_per_node under Ray."""
        t = self.trainer
        if self.cluster.backend == "ray":
            return t.nnodes * (t.n_devices_per_node or t.nproc)
        return t.nproc

    @model_validator(mode="after")
    def _batches_divide(self) -> RunConfig:
        mb = self.actor.mini_batch_size
        batch = self.trainer.prompts_per_step * self.algorithm.group_size
        world = self.world_size
        if self.cluster.backend == "local" and self.trainer.nnodes != 1:
            raise ValueError("trainer.nnodes > 1 needs cluster.backend: ray (local ranks share one machine)")
        if self.trainer.prompts_per_step % world:
            raise ValueError(
                f"trainer.prompts_per_step ({self.trainer.prompts_per_step}) must be a multiple of the "
                f"number of ranks ({world}): every rank takes an equal share of the prompts"
            )
        if (mb or batch) % world:
            raise ValueError(
                f"actor.mini_batch_size ({mb or batch}) must be a multiple of the number of ranks ({world})"
            )
        if mb is not None and batch % mb:
            raise ValueError(
                f"actor.mini_batch_size ({mb}) must divide the rollout batch "
                f"(trainer.prompts_per_step x algorithm.group_size = {batch})"
            )
        micro = self.actor.micro_batch_size
        if micro is not None and (mb or batch) // world % micro:
            raise ValueError(
                f"actor.micro_batch_size ({micro}) must divide each rank's share of the mini-batch "
                f"({mb or batch} / {world} ranks)"
            )
        if self.critic.path is not None and not Path(self.critic.path).expanduser().is_dir():
            raise ValueError(f"critic.path: no such model directory: {self.critic.path}")
        return self

    @model_validator(mode="after")
    def _validation_has_prompts(self) -> RunConfig:
        validates = self.trainer.val_every > 0 or self.trainer.val_before_train
        if self.checkpoint.keep_best is not None and not self.trainer.val_every:
            raise ValueError(
                "checkpoint.keep_best ranks snapshots by a validation metric, but this run never validates "
                "after it starts: set trainer.val_every to N > 0"
            )
        if validates and self.data.path is not None and self.data.val_path is None:
            raise ValueError(
                "trainer.val_every / val_before_train need held-out prompts: set data.val_path "
                "(only the built-in task has a held-out split of its own)"
            )
        return self

    @property
    def validates(self) -> bool:
        """Whether the run validates at all."""
        return self.trainer.val_every > 0 or self.trainer.val_before_train

    def to_yaml(self) -> str:
        """The config as YAML. Every snapshot writes one, and the config rarely changes between them: the
        last text is kept, keyed by the repr of the config's values (20x cheaper to make than the YAML;
        unlike JSON, it tells inf, nan and None apart)."""
        global _RENDERED
        key, (last_key, last_text) = repr(self.model_dump()), _RENDERED
        if key == last_key:
            return last_text
        # libyaml's emitter where PyYAML has it: the same text, 4x faster
        dumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
        text = yaml.dump(self.model_dump(mode="json"), Dumper=dumper, sort_keys=False)
        _RENDERED = (key, text)
        return text
