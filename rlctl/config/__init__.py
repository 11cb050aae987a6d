"""The run config: the strict schema (``schema``: ``RunConfig`` of the sections in ``sections``,
``reward`` and ``algorithm``, whose choices derive from the registries of ``rlctl.algos``), its knobs
and their schedules (``knob_values``), where it was read (``provenance``), and its loading from YAML and
``--set`` with located errors (``load``)."""

from rlctl.config.algorithm import (
    ActorConfig,
    AlgorithmConfig,
    CriticConfig,
    DynamicSamplingConfig,
    KLControllerConfig,
    OverlongConfig,
)
from rlctl.config.knob_values import ScheduleConfig, ScheduleEntry, adjust_knob, follow_schedules, get_knob, set_knob
from rlctl.config.load import (
    BUILTIN_CONFIG,
    DEMO_CONFIG,
    check_adjust_fits,
    check_policies_fit,
    inline_policies,
    load_config,
    parse_set,
    validate_config,
)
from rlctl.config.provenance import Provenance
from rlctl.config.reward import RewardConfig
from rlctl.config.schema import RunConfig
from rlctl.config.sections import (
    BuiltinModelConfig,
    CheckpointConfig,
    ClusterConfig,
    DataConfig,
    ModelConfig,
    RolloutConfig,
    TrainerConfig,
)

__all__ = [
    "BUILTIN_CONFIG",
    "DEMO_CONFIG",
    "ActorConfig",
    "AlgorithmConfig",
    "BuiltinModelConfig",
    "CheckpointConfig",
    "ClusterConfig",
    "CriticConfig",
    "DataConfig",
    "DynamicSamplingConfig",
    "KLControllerConfig",
    "ModelConfig",
    "OverlongConfig",
    "Provenance",
    "RewardConfig",
    "RolloutConfig",
    "RunConfig",
    "ScheduleConfig",
    "ScheduleEntry",
    "TrainerConfig",
    "adjust_knob",
    "check_adjust_fits",
    "check_policies_fit",
    "follow_schedules",
    "get_knob",
    "inline_policies",
    "load_config",
    "parse_set",
    "set_knob",
    "validate_config",
]
