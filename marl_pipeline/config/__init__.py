"""Experiment config: one YAML file, loaded into typed, validated objects before anything runs.

Unknown keys are errors everywhere (``extra="forbid"``); cross-field checks (agents against the
environment's roles) run in :func:`load_config` so a bad file fails before the store is touched.
Modules: ``base`` (shared), ``agent`` (one agent's model, engine, trainer, warm-up), ``pipeline``
(environment, micro-batches), ``algorithm`` (policy gradient, advantage estimator), ``run`` (what a run uses
besides its agents: reward model, evaluation, health, Ray, store, tracking, retraining), ``services`` (services
outside the cluster, the judge reward) and
``experiment`` (the whole file, its loading and cross-checks).
"""

from marl_pipeline.config.agent import AgentConfig, EngineConfig, LoraAdapterConfig, TrainerConfig, WarmupConfig
from marl_pipeline.config.algorithm import (
    Advantage,
    AgentNormalizedAdvantage,
    AlgorithmConfig,
    DrGRPOAdvantage,
    GRPOAdvantage,
    RLOOAdvantage,
)
from marl_pipeline.config.base import BUILTIN_TINY, ConfigError, StrictModel
from marl_pipeline.config.experiment import (
    AgentSlice,
    ExperimentConfig,
    apply_overrides,
    apply_settings,
    dotted_overrides,
    load_config,
    parse_config,
    read_config_data,
    validated_overrides,
)
from marl_pipeline.config.pipeline import (
    EnvironmentConfig,
    PipelineConfig,
    PoolSettings,
    RolloutConfig,
)
from marl_pipeline.config.run import (
    EvaluationConfig,
    HealthConfig,
    RayConfig,
    RetentionConfig,
    RetrainConfig,
    RewardModelConfig,
    StoreConfig,
    TrackingConfig,
    WandbConfig,
)
from marl_pipeline.config.services import JudgeConfig, RewardConfig, ServiceConfig

__all__ = [
    "BUILTIN_TINY",
    "Advantage",
    "AgentConfig",
    "AgentNormalizedAdvantage",
    "AgentSlice",
    "AlgorithmConfig",
    "ConfigError",
    "DrGRPOAdvantage",
    "EngineConfig",
    "EnvironmentConfig",
    "EvaluationConfig",
    "ExperimentConfig",
    "GRPOAdvantage",
    "HealthConfig",
    "JudgeConfig",
    "LoraAdapterConfig",
    "PipelineConfig",
    "PoolSettings",
    "RLOOAdvantage",
    "RayConfig",
    "RetentionConfig",
    "RetrainConfig",
    "RewardConfig",
    "RewardModelConfig",
    "RolloutConfig",
    "ServiceConfig",
    "StoreConfig",
    "StrictModel",
    "TrackingConfig",
    "TrainerConfig",
    "WandbConfig",
    "WarmupConfig",
    "apply_overrides",
    "apply_settings",
    "dotted_overrides",
    "load_config",
    "parse_config",
    "read_config_data",
    "validated_overrides",
]
