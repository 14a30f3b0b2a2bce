"""The whole experiment file and its loading: typed, validated, cross-checked against the environment."""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import BeforeValidator, Field, ValidationError, field_validator, model_validator

from marl_pipeline.config.agent import AgentConfig
from marl_pipeline.config.algorithm import Advantage, AlgorithmConfig, with_own_values
from marl_pipeline.config.base import BUILTIN_TINY, ConfigError, StrictModel
from marl_pipeline.config.pipeline import EnvironmentConfig, PipelineConfig
from marl_pipeline.config.run import (
    EvaluationConfig,
    HealthConfig,
    RayConfig,
    RetrainConfig,
    RewardModelConfig,
    StoreConfig,
    TrackingConfig,
    _store_from_uri,
)
from marl_pipeline.config.services import RewardConfig, ServiceConfig


def _roles(agent: str, settings: AgentConfig) -> list[str]:
    """The roles an agent plays: its ``roles``, else the one named as it."""
    return list(settings.roles or [agent])


@dataclass(frozen=True)
class AgentSlice:
    """What one agent's actors are built from (cluster/specs.py): its settings, the algorithm values it trains with
    and its seed; never the whole experiment."""

    name: str
    settings: AgentConfig
    algorithm: AlgorithmConfig
    seed: int
    """The experiment's seed plus the agent's place among the agents."""


class ExperimentConfig(StrictModel):
    """A whole experiment: what the ``marl train`` command and the Dagster ``train`` job take."""

    run: str = Field(pattern=r"^[A-Za-z0-9_.]+$")
    """Run name: one training lineage in the store; letters, digits, ``_`` and ``.``."""
    seed: int = 0
    """Seeds task sampling, model building, warm-up and rollout sampling."""
    store: Annotated[StoreConfig, BeforeValidator(_store_from_uri)] = StoreConfig()
    """Experience store: a URI string (local directory or ``s3://...``) or a mapping of ``StoreConfig`` fields."""
    environment: EnvironmentConfig
    agents: dict[str, AgentConfig]
    pipeline: PipelineConfig = PipelineConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    reward_model: RewardModelConfig | None = None
    """A model-based reward mixed into the environment's (None: the environment's rule-based reward alone)."""
    reward: RewardConfig = RewardConfig()
    """Rewards asked of services outside the cluster (an LLM judge)."""
    services: dict[str, ServiceConfig] = Field(default_factory=dict)
    """External services the plugin and the judge call, by name, each under its quota
    (``marl_pipeline.environment.service(name)``)."""
    evaluation: EvaluationConfig = EvaluationConfig()
    health: HealthConfig = HealthConfig()
    """When the training-health signals are reported as collapse."""
    ray: RayConfig = RayConfig()
    retrain: RetrainConfig = RetrainConfig()
    tracking: TrackingConfig = TrackingConfig()

    @field_validator("agents")
    @classmethod
    def validate_agents_not_empty(cls, agents: dict[str, AgentConfig]) -> dict[str, AgentConfig]:
        if not agents:
            raise ValueError("at least one agent is required")
        return agents

    @field_validator("services")
    @classmethod
    def validate_service_names(cls, services: dict[str, ServiceConfig]) -> dict[str, ServiceConfig]:
        for name in services:
            if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
                raise ValueError(f"service name {name!r}: letters, digits, '_', '.' and '-' only")
        return services

    @model_validator(mode="after")
    def validate_judge(self) -> ExperimentConfig:
        judge = self.reward.judge
        if judge is not None and judge.service not in self.services:
            raise ValueError(f"reward.judge.service {judge.service!r} is not among services {sorted(self.services)}")
        if judge is not None and self.reward_model is not None:
            raise ValueError("reward.judge and reward_model are both set: a run mixes one model's score into its "
                             "reward; keep one")
        return self

    @model_validator(mode="after")
    def validate_agent_staleness(self) -> ExperimentConfig:
        if self.pipeline.mode == "synchronous" and (loose := [a for a, s in self.agents.items() if s.staleness]):
            raise ValueError(f"agents.{loose[0]}.staleness: synchronous mode samples each step from the versions "
                             f"of the step before; set pipeline.mode: streaming for a bound above 0")
        return self

    @model_validator(mode="after")
    def validate_agent_sync(self) -> ExperimentConfig:
        bounds = self.staleness_bounds()
        for agent, settings in self.agents.items():
            if settings.sync_every > 1 and bounds[agent] < settings.sync_every - 1:
                where = ("synchronous mode samples each step from the versions of the step before"
                         if self.pipeline.mode == "synchronous" else f"its staleness bound is {bounds[agent]}")
                raise ValueError(f"agents.{agent}.sync_every: {settings.sync_every} lets its turns be sampled up to "
                                 f"{settings.sync_every - 1} versions behind, and {where}: set "
                                 f"agents.{agent}.staleness (or pipeline.staleness) to at least "
                                 f"{settings.sync_every - 1} in streaming mode")
        return self

    @model_validator(mode="after")
    def validate_agent_algorithms(self) -> ExperimentConfig:
        for agent in self.agents:
            try:
                self.algorithm_of(agent)
            except ValidationError as error:
                item = error.errors()[0]
                field = ".".join(str(part) for part in item["loc"])
                raise ValueError(f"agents.{agent}.algorithm.{field}: {item['msg']} (over the experiment's "
                                 f"algorithm)") from None
        return self

    @field_validator("agents")
    @classmethod
    def validate_roles_played_once(cls, agents: dict[str, AgentConfig]) -> dict[str, AgentConfig]:
        players: dict[str, list[str]] = {}
        for agent, settings in agents.items():
            for role in _roles(agent, settings):
                players.setdefault(role, []).append(agent)
        if twice := {role: names for role, names in players.items() if len(names) > 1}:
            role, names = next(iter(twice.items()))
            raise ValueError(f"agents {names} all play role {role!r}: each role has one agent (its policy)")
        return agents

    def role_agents(self) -> dict[str, str]:
        """Each role and the agent that plays it (``agents.<a>.roles``, else the agent named as the role)."""
        return {role: agent for agent, settings in self.agents.items() for role in _roles(agent, settings)}

    def roles_played(self, agent: str) -> list[str]:
        """The roles ``agent`` plays with its policy: its ``roles``, else the one named as it."""
        return _roles(agent, self.agents[agent])

    def algorithm_of(self, agent: str) -> AlgorithmConfig:
        """The algorithm settings ``agent`` samples, scores and trains with: the experiment's ``algorithm:`` with
        the agent's own values (``agents.<a>.algorithm``) in place of those it sets."""
        own = self.agents[agent].algorithm.model_dump(exclude_none=True)
        if not own:
            return self.algorithm
        return AlgorithmConfig.model_validate(with_own_values(self.algorithm.model_dump(), own))

    def agent_slice(self, agent: str) -> AgentSlice:
        """``agent``'s slice of the experiment: its settings, its algorithm values and its seed (the one rule)."""
        return AgentSlice(agent, self.agents[agent], self.algorithm_of(agent),
                          self.seed + list(self.agents).index(agent))

    def staleness_bounds(self) -> dict[str, int]:
        """Per agent, the most versions its turns may lag their step (``agents.<a>.staleness``, else
        ``pipeline.staleness``; 0 in synchronous mode): what the staleness gate holds each agent to."""
        return {agent: self.pipeline.staleness_bound(settings.staleness) for agent, settings in self.agents.items()}

    def advantages(self) -> dict[str, Advantage]:
        """Per agent, the advantage estimator its rewards become advantages by."""
        return {agent: self.algorithm_of(agent).advantage for agent in self.agents}

    def dropping_zero_advantage_groups(self) -> frozenset[str]:
        """The agents whose trainers leave out groups that all earned the same reward (DAPO's filter)."""
        return frozenset(agent for agent in self.agents if self.algorithm_of(agent).drop_zero_advantage_groups)

    def laid_out(self, layouts: Mapping[str, int | None]) -> ExperimentConfig:
        """The experiment with each agent of ``layouts`` in its ``parallelism_by_length`` entry (None: as set)."""
        if not any(index is not None for index in layouts.values()):
            return self
        agents = {name: agent.laid_out(layouts.get(name)) for name, agent in self.agents.items()}
        return self.model_copy(update={"agents": agents})

    def turn_adapters(self) -> dict[str, dict[str, list[int]]]:
        """Per agent that has them, its ``turn_adapters``: named adapters and the own turns they serve."""
        return {agent: dict(a.turn_adapters) for agent, a in self.agents.items() if a.turn_adapters}


def _format_validation_error(error: ValidationError, source: str) -> str:
    lines = [f"invalid config {source}:"]
    for item in error.errors():
        field = ".".join(str(part) for part in item["loc"]) or "<root>"
        message = "unknown field" if item["type"] == "extra_forbidden" else item["msg"]
        lines.append(f"  {field}: {message}")
    return "\n".join(lines)


def parse_config(data: dict[str, Any], source: str = "<dict>", layouts: bool = True) -> ExperimentConfig:
    """Validate a config dict, including agents against the environment's roles (and, with ``layouts``, the
    experiment as each agent's ``parallelism_by_length`` entries lay it out).

    Raises:
        ConfigError: naming each offending field.
    """
    from marl_pipeline.environment import TEAM, get_environment_class, roles_of
    from marl_pipeline.hooks import hooks_of, missing_hooks

    if not isinstance(data, dict):
        raise ConfigError(f"invalid config {source}: expected a mapping at the top level")
    try:
        config = ExperimentConfig.model_validate(data)
    except ValidationError as error:
        raise ConfigError(_format_validation_error(error, source)) from None
    try:
        env_class = get_environment_class(config.environment.name)
    except KeyError as error:
        raise ConfigError(f"invalid config {source}:\n  environment.name: {error.args[0]}") from None
    roles = roles_of(env_class)
    for name, agent in config.agents.items():
        if unknown := [role for role in config.roles_played(name) if role not in roles]:
            where, what = (f"agents.{name}.roles", f"unknown role {unknown[0]!r}") if agent.roles else (
                f"agents.{name}", "unknown agent (it plays the role named as it; `roles:` names others)")
            raise ConfigError(f"invalid config {source}:\n  {where}: {what}; environment "
                              f"{config.environment.name!r} has roles {list(roles)}")
        if agent.roles and name in roles and name not in agent.roles:
            raise ConfigError(f"invalid config {source}:\n  agents.{name}.roles: {agent.roles} leaves out the role "
                              f"named as the agent; name the agent otherwise or play that role too")
    played = config.role_agents()
    missing = [role for role in roles if role not in played]
    if missing:
        raise ConfigError(f"invalid config {source}:\n  agents: no agent plays role(s) {missing} of the environment "
                          f"(an agent plays the role named as it, or those under its `roles:`)")
    if TEAM in roles:
        raise ConfigError(f"invalid config {source}:\n  environment: {config.environment.name!r} has a role named "
                          f"{TEAM!r}, the name the team's held-out evaluation is stored under; rename the role")
    answering = hooks_of(env_class).answering_role
    if answering not in roles:
        raise ConfigError(f"invalid config {source}:\n  environment: {config.environment.name!r} gives the team's "
                          f"answer to role {answering!r} (answering_role), which it does not have; roles {list(roles)}")
    if hooks_of(env_class).next_role is not None and (turns := hooks_of(env_class).max_turns) < 1:
        raise ConfigError(f"invalid config {source}:\n  environment: {config.environment.name!r} decides its turns "
                          f"(next_role) and cuts an episode at max_turns {turns}; it must be 1 or more")
    if config.pipeline.rollout.rebalance_replicas:
        asks = {name: (agent.engine.num_cpus, agent.engine.num_gpus) for name, agent in config.agents.items()}
        if len(set(asks.values())) > 1:
            raise ConfigError(f"invalid config {source}:\n  pipeline.rollout.rebalance_replicas: moves replicas "
                              f"between agents, so every agent's engine must ask for the same num_cpus and num_gpus; "
                              f"they ask for {asks}")
    resident = config.ray.resident_trainers
    if config.ray.weight_sync == "broadcast" and resident is not None and resident < len(config.agents):
        raise ConfigError(f"invalid config {source}:\n  ray.weight_sync: broadcast sends from each agent's own "
                          f"trainer actor, and ray.resident_trainers: {resident} swaps "
                          f"{len(config.agents)} agents through fewer trainers; use object_store with swapping")
    if hybrid := [name for name, agent in config.agents.items() if agent.hybrid]:
        if config.ray.weight_sync == "broadcast":
            raise ConfigError(f"invalid config {source}:\n  agents {hybrid} are hybrid: their trainer and engine "
                              f"share a process, which a broadcast group cannot join twice; use ray.weight_sync: "
                              f"object_store")
        if resident is not None and resident < len(config.agents):
            raise ConfigError(f"invalid config {source}:\n  agents {hybrid} are hybrid: their trainers live in "
                              f"their engines' processes, which ray.resident_trainers: {resident} cannot swap; leave "
                              f"it unset")
    if colocated := [name for name, agent in config.agents.items() if agent.colocated]:
        _check_colocation(config, colocated, source)
    reward_model = config.reward_model
    if reward_model is not None:
        unknown = [name for name in reward_model.agents or [] if name not in roles]
        if unknown:
            raise ConfigError(f"invalid config {source}:\n  reward_model.agents: unknown agent {unknown[0]!r}; "
                              f"environment {config.environment.name!r} has roles {list(roles)}")
    judge = config.reward.judge
    if judge is not None and (unknown := [name for name in judge.agents or [] if name not in roles]):
        raise ConfigError(f"invalid config {source}:\n  reward.judge.agents: unknown agent {unknown[0]!r}; "
                          f"environment {config.environment.name!r} has roles {list(roles)}")
    missing = missing_hooks(
        env_class, builtin_model=any(agent.model == BUILTIN_TINY for agent in config.agents.values()),
        warmup=any(agent.warmup.steps > 0 for agent in config.agents.values()),
        builtin_reward_model=reward_model is not None and reward_model.model == BUILTIN_TINY,
        evaluation=config.evaluation.every is not None)
    if missing:
        raise ConfigError(f"invalid config {source}:\n  environment: {config.environment.name!r} lacks what this "
                          f"config needs: {', '.join(missing)} (docs/environments.md)")
    try:
        env_class.Options.model_validate(config.environment.options)
    except ValidationError as error:
        raise ConfigError(_format_validation_error(error, source).replace("\n  ", "\n  environment.options.")) from None
    for name, agent in config.agents.items():  # each layout a run can take must be a valid experiment too
        for index in range(len(agent.parallelism_by_length) if layouts else 0):
            laid = config.laid_out({name: index}).model_dump()
            parse_config(laid, f"{source} with agents.{name}.parallelism_by_length[{index}]", layouts=False)
    return config


def _check_colocation(config: ExperimentConfig, colocated: list[str], source: str) -> None:
    """What agents whose engine and trainer share GPUs (``agents.<a>.colocated``) need of the rest of the config."""
    why = None
    if config.pipeline.mode != "synchronous":
        why = ("pipeline.mode must be synchronous: an engine and a trainer sharing GPUs take turns, a whole step's "
               "rollout then its training, and streaming overlaps them")
    elif config.ray.weight_sync == "broadcast":
        why = ("ray.weight_sync must be object_store: NCCL refuses two ranks of one group on one GPU, and the engine's "
               "and the trainer's ranks share theirs")
    elif (resident := config.ray.resident_trainers) is not None and resident < len(config.agents):
        why = f"ray.resident_trainers: {resident} would swap their trainers out of the GPUs they share; leave it unset"
    if why:
        raise ConfigError(f"invalid config {source}:\n  agents {colocated} are colocated: {why}")


def read_config_data(path: str | Path) -> dict[str, Any]:
    """The raw mapping of one YAML experiment file, not yet validated."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:
        raise ConfigError(f"invalid YAML in {path}: {error}") from None
    return data


def apply_overrides(data: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of experiment ``data`` with ``overrides`` (nested like the file) merged in: mappings merge key by
    key, any other value replaces. A plain-string ``store`` is read as its ``uri`` first, so that overriding one
    store setting keeps the file's URI."""
    if isinstance(data.get("store"), str | Path) and isinstance(overrides.get("store"), Mapping):
        data = {**data, "store": _store_from_uri(data["store"])}
    return _merged(data, overrides)


def dotted_overrides(settings: list[str], agents: list[str]) -> dict[str, Any]:
    """``KEY=VALUE`` settings (``pipeline.steps=5``, ``seed=1``; each value read as YAML) as overrides nested like the
    experiment file, for :func:`apply_overrides`; ``agents.*.KEY`` sets KEY for every one of ``agents``."""
    overrides: dict[str, Any] = {}
    for setting in settings:
        path, equals, text = setting.partition("=")
        keys = path.strip().split(".")
        if not equals or not all(keys):
            raise ConfigError(f"--set {setting!r}: expected KEY=VALUE, the key dotted as the file nests it "
                              f"(pipeline.steps=5, agents.solver.trainer.lr=1e-5, agents.*.engine.replicas=2)")
        if "*" in keys[:1] + keys[2:] or (keys[1:2] == ["*"] and keys[0] != "agents"):
            raise ConfigError(f"--set {setting!r}: '*' stands for every agent, as agents.*.KEY, and nowhere else")
        value = yaml.safe_load(text)
        for path_keys in ([["agents", agent, *keys[2:]] for agent in agents] if keys[1:2] == ["*"] else [keys]):
            overrides = _merged(overrides, functools.reduce(lambda inner, key: {key: inner}, reversed(path_keys),
                                                            value))
    return overrides


def apply_settings(data: Any, source: str, settings: list[str]) -> tuple[ExperimentConfig, dict[str, Any]]:
    """Experiment ``data`` (read from ``source``) with ``KEY=VALUE`` settings (``marl train --set``) applied,
    validated, and the settings as overrides nested like the file, each value as the validated experiment holds it
    (:func:`validated_overrides`); ``{}`` when there are none."""
    if not settings:
        return parse_config(data, source=source), {}
    if not isinstance(data, dict):
        raise ConfigError(f"invalid config {source}: expected a mapping at the top level")
    overrides = dotted_overrides(settings, list(data.get("agents") or {}))
    config = parse_config(apply_overrides(data, overrides), source=f"{source} with --set {' '.join(settings)}")
    return config, validated_overrides(overrides, config)


def validated_overrides(overrides: Mapping[str, Any], config: ExperimentConfig) -> dict[str, Any]:
    """``overrides`` with each value replaced by what ``config``, the experiment they made, holds at its place: typed
    as the models read it (YAML's ``1e-5``, a string, as the float it means; a store's URI as the store's settings),
    which is what a run config's overrides, typed from the same models, take (resources/overrides.py)."""
    return _held(overrides, config.model_dump(mode="json"))


def _held(overrides: Any, held: Any) -> Any:
    if isinstance(overrides, Mapping) and isinstance(held, Mapping):
        return {key: _held(value, held[key]) if key in held else value for key, value in overrides.items()}
    if isinstance(held, Mapping):  # a value the models read as a mapping: its set fields
        return {key: _held(value, value) for key, value in held.items() if value is not None}
    return held


def _merged(data: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(data)
    for key, value in overrides.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = _merged(merged[key], value)
        else:
            merged[key] = value
    return merged


def load_config(path: str | Path) -> ExperimentConfig:
    """Read and validate one YAML experiment file."""
    return parse_config(read_config_data(path), source=str(path))
