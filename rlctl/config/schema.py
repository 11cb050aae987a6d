"""The run config's schema: ``RunConfig``, the strict pydantic model of a run, made of its sections
(``sections``, ``reward``, ``algorithm``) and the rules that tie them together.

Every field carries a description (a test checks it), so ``rlctl start --help`` and the config reference
in docs/ are generated from one place. Validation is pure: it checks the shape and values of a config,
never the machine it is read on, so a run's saved config.yaml reads anywhere; whether the files and
storage it names are there is ``rlctl.preflight``'s question, asked when a run starts or resumes.
Where the config was read (``Provenance``) travels with it, for the preflight's sentences. Loading
files and ``--set`` is ``load``'s job.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, PrivateAttr, ValidationInfo, field_validator, model_validator

from rlctl.config.algorithm import ActorConfig, AlgorithmConfig, CriticConfig
from rlctl.config.knob_values import KnobKey, ScheduleConfig, domain, in_domain, lift_schedules, may_exceed, set_knob
from rlctl.config.provenance import Provenance
from rlctl.config.reward import DEFAULT_REWARD, NO_REWARD, RewardConfig
from rlctl.config.sections import CheckpointConfig, ClusterConfig, DataConfig, ModelConfig, RolloutConfig, TrainerConfig
from rlctl.config.strict import Strict
from rlctl.errors import ConfigError
from rlctl.faults import parse as parse_faults
from rlctl.policies.schema import PolicySpec
from rlctl.yamlsrc import dump_saved

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

    _provenance: Provenance = PrivateAttr(default_factory=Provenance)

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
        return self

    @model_validator(mode="after")
    def _fp16_is_partitioned(self) -> RunConfig:
        """Stage 0's fp16 optimizer lacks the loss-scale hysteresis rlctl's fp16 runs rely on (a dtype
        that ``auto`` resolves to fp16 is refused when the engine is built, ``ds_module.ds_config``)."""
        sections = [("actor", self.actor)] + ([("critic", self.critic)] if self.algorithm.name == "ppo" else [])
        for name, section in sections:
            if self.model.dtype == "fp16" and section.zero_stage == 0:
                raise ValueError(
                    f"model.dtype fp16 needs {name}.zero_stage 1, 2 or 3: at stage 0 DeepSpeed's fp16 optimizer "
                    "scales the loss without the hysteresis rlctl's fp16 runs rely on; use bf16 or fp32"
                )
        return self

    @model_validator(mode="after")
    def _staleness_is_asyncs(self) -> RunConfig:
        mode = self.rollout.mode
        if self.rollout.max_staleness != 1 and mode != "async":
            raise ValueError(f"rollout.max_staleness applies with rollout.mode async (the mode is {mode})")
        return self

    @model_validator(mode="after")
    def _multi_turn_is_chat(self) -> RunConfig:
        if self.rollout.multi_turn is not None and not self.data.apply_chat_template:
            raise ValueError(
                "rollout.multi_turn renders the conversation with the chat template: set data.apply_chat_template "
                "to true"
            )
        r, mt = self.reward, self.rollout.multi_turn
        own = r.function != DEFAULT_REWARD or r.sources is not None or r.url is not None or r.model is not None
        if mt is not None and mt.environment is not None and not own:
            r.function = NO_REWARD  # the built-in task's reward means nothing here: the environment's alone
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
    def provenance(self) -> Provenance:
        """Where the config was read (no part of its value): the lead and key origins of later sentences."""
        return self._provenance

    def read_from(self, provenance: Provenance) -> RunConfig:
        """The config, remembering where it was read."""
        self._provenance = provenance
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
        text = dump_saved(self.model_dump(mode="json"))  # (read back by yamlsrc.load_yaml as SAVED)
        _RENDERED = (key, text)
        return text
