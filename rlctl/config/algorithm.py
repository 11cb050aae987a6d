"""The RL algorithm's config and the two models it trains (actor, critic). The choices of the RL maths
(advantage estimators, KL estimators, loss aggregation modes, importance-ratio levels, KL controllers)
are the names of the registries in ``rlctl.algos.registry``, never a second list."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from rlctl.algos.registry import (
    ADVANTAGES,
    AGG_MODES,
    GROUP_ESTIMATORS,
    KL_CONTROLLERS,
    KL_ESTIMATORS,
    POLICY_LOSS_LEVELS,
    ROLLOUT_CORRECTIONS,
)
from rlctl.config.strict import Strict

AdvEstimator = Literal[ADVANTAGES.names]
KLEstimator = Literal[KL_ESTIMATORS.names]
LossAggMode = Literal[AGG_MODES.names]
PolicyLossLevel = Literal[POLICY_LOSS_LEVELS.names]
KLControllerType = Literal[KL_CONTROLLERS.names]
RolloutCorrectionMode = Literal[("none", *ROLLOUT_CORRECTIONS.names)]


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


class RolloutCorrectionConfig(Strict):
    mode: RolloutCorrectionMode = Field(
        "none",
        description="Off-policy correction of the policy loss by each token's ratio rho = pi_old / pi_rollout (the "
        "trainer's log-probs before the update against the rollout engine's): none: no correction; tis: truncated "
        "importance sampling, each token's loss times min(rho, cap); masked: tokens with rho outside [1/cap, cap] "
        "weigh 0. No correction where a batch has no rollout log-probs (the degenerate drill).",
    )
    cap: float = Field(
        2.0, gt=1, description="tis: the largest weight a token's loss gets; masked: tokens outside [1/cap, cap] drop."
    )


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
    rollout_correction: RolloutCorrectionConfig = Field(
        default_factory=RolloutCorrectionConfig,
        description="Token-level correction for the gap between the rollout engine's and the trainer's log-probs "
        "(verl's rollout correction; docs/algorithms.md).",
    )

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
        if key == "algorithm.rollout_correction.cap" and self.rollout_correction.mode == "none":
            return "algorithm.rollout_correction.mode is none (the cap bounds the tis and masked corrections only)"
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
    zero_stage: Literal[0, 1, 2, 3] = Field(
        2,
        description="DeepSpeed ZeRO stage of the actor; 0: no partitioning (each rank holds the whole "
        "optimizer state; several ranks are plain data parallelism; not with model.dtype fp16). A run of one "
        "rank trains stage 1 or 2 at stage 0 (unless fp16, or resumed from a snapshot of its stage), and its "
        "snapshots resume onto more ranks at this stage.",
    )
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
        "of a mini-batch, and per forward of the actor's no-grad passes; empty: that whole share (on a GPU, "
        "see max_tokens_per_micro_batch).",
    )
    max_tokens_per_micro_batch: int | None = Field(
        None,
        ge=1,
        description="Dynamic batching (verl's use_dynamic_bsz, ppo_max_token_len_per_gpu): each rank's share "
        "of a mini-batch sorted by length and cut into micro-batches of at most this many padded tokens "
        "(rows x (longest prompt + longest response)), for the actor's and critic's updates and their "
        "no-grad passes; the loss stays the exact mini-batch mean. Empty: by micro_batch_size; with both "
        "empty, on a GPU a budget sized from the free device memory at start (rlctl/engine/token_budget.py), "
        "on the CPU the whole share.",
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
    zero_stage: Literal[0, 1, 2, 3] = Field(
        2,
        description="DeepSpeed ZeRO stage of the critic; 0: no partitioning (not with model.dtype fp16). One "
        "rank trains stage 1 or 2 at stage 0, as actor.zero_stage.",
    )
    grad_clip: float = Field(1.0, gt=0, description="Clip the critic's gradient norm to this value.")
    cliprange_value: float = Field(0.5, gt=0, description="Value clipping range around the old values.")
    warmup_steps: int = Field(0, ge=0, description="Steps that train only the critic before the actor starts.")
    gradient_checkpointing: bool = Field(
        False, description="Recompute the critic's activations in the backward pass (less memory, more compute)."
    )
