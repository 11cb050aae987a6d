"""The run config: the strict schema (``schema``, choices derived from the registries of
``rlctl.engine.algos``) and its loading from YAML and ``--set`` with located errors (``load``)."""

from rlctl.config.load import (
    BUILTIN_CONFIG,
    DEMO_CONFIG,
    check_policies_fit,
    inline_policies,
    load_config,
    parse_set,
    validate_config,
)
from rlctl.config.schema import (
    ActorConfig,
    AlgorithmConfig,
    BuiltinModelConfig,
    CheckpointConfig,
    ClusterConfig,
    CriticConfig,
    DataConfig,
    DynamicSamplingConfig,
    KLControllerConfig,
    ModelConfig,
    OverlongConfig,
    RewardConfig,
    RolloutConfig,
    RunConfig,
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
    "RewardConfig",
    "RolloutConfig",
    "RunConfig",
    "TrainerConfig",
    "check_policies_fit",
    "inline_policies",
    "load_config",
    "parse_set",
    "validate_config",
]
