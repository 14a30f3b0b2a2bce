"""Experiment config: one YAML file, loaded into typed, validated objects before anything runs.

Unknown keys are errors everywhere (``extra="forbid"``); cross-field checks (agents against the
environment's roles) run in :func:`load_config` so a bad file fails before the store is touched.
Modules: ``base`` (shared), ``agent`` (one agent's model, engine, trainer, warm-up), ``pipeline``
(environment, micro-batches, algorithm), ``services`` (reward model, evaluation, Ray, store) and
``experiment`` (the whole file, its loading and cross-checks).
"""

from marl_pipeline.config.agent import AgentConfig, EngineConfig, LoraAdapterConfig, TrainerConfig, WarmupConfig
from marl_pipeline.config.base import BUILTIN_TINY, ConfigError, StrictModel
from marl_pipeline.config.experiment import (
    ExperimentConfig,
    apply_overrides,
    load_config,
    parse_config,
    read_config_data,
)
from marl_pipeline.config.pipeline import (
    AlgorithmConfig,
    EnvironmentConfig,
    PipelineConfig,
    PoolSettings,
    RolloutConfig,
)
from marl_pipeline.config.services import (
    EvaluationConfig,
    RayConfig,
    RetentionConfig,
    RetrainConfig,
    RewardModelConfig,
    StoreConfig,
)

__all__ = [
    "BUILTIN_TINY",
    "AgentConfig",
    "AlgorithmConfig",
    "ConfigError",
    "EngineConfig",
    "EnvironmentConfig",
    "EvaluationConfig",
    "ExperimentConfig",
    "LoraAdapterConfig",
    "PipelineConfig",
    "PoolSettings",
    "RayConfig",
    "RetentionConfig",
    "RetrainConfig",
    "RewardModelConfig",
    "RolloutConfig",
    "StoreConfig",
    "StrictModel",
    "TrainerConfig",
    "WarmupConfig",
    "apply_overrides",
    "load_config",
    "parse_config",
    "read_config_data",
]
