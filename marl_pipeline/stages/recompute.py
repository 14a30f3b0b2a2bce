"""Per-partition execution: recompute one stage of one stored micro-batch from its stored inputs.

The same stage functions as the streaming orchestrator; inputs come from the store, the output
replaces the stored partition (atomically). Rollout needs Ray (it starts the engines); environment
actions run on the process's shared action pool when Ray is up (the Dagster assets that run them require
the Ray resource), else in-process; reward and policy updates run in-process.

Not to be confused with a replay buffer: nothing is sampled from old experience for training here.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from pathlib import Path

import pyarrow as pa

from marl_pipeline.actions.pool import shared_pool
from marl_pipeline.bootstrap.reward_model import prepare_reward_model
from marl_pipeline.cluster.specs import trainer_options
from marl_pipeline.cluster.trainers import with_local_base
from marl_pipeline.config import ExperimentConfig
from marl_pipeline.environment import build_environment
from marl_pipeline.inference.reward_model import RewardModelServer
from marl_pipeline.services.scheduler import connect, start_services, stop_services
from marl_pipeline.stages.evaluation import EvaluationSettings, evaluate_agent, is_evaluated, with_metrics
from marl_pipeline.stages.execution import action_pool_settings, execute_micro_batch
from marl_pipeline.stages.reward import ModelReward, model_reward, score_micro_batch
from marl_pipeline.stages.team import evaluate_team, is_team_evaluated
from marl_pipeline.stages.training import train_batch_for, updates_table
from marl_pipeline.stages.trajectories import sample_micro_batch
from marl_pipeline.store import ExperienceStore, MicroBatchKey
from marl_pipeline.store.schema import with_stage_timing
from marl_pipeline.training.trainer import PolicyTrainer


def recompute_stage(stage: str, config: ExperimentConfig, store: ExperienceStore,
                    key: MicroBatchKey) -> tuple[Path, pa.Table, float]:
    """Recompute and commit ``stage`` for ``key`` in ``store`` (the run's store); returns (partition path,
    table, seconds)."""
    if key.run != config.run:
        raise ValueError(f"partition of run {key.run!r}, but the experiment config is for run {config.run!r}")
    env = build_environment(config.environment.name, config.environment.options)
    # The plugin and the judge call the run's services: under the live launch's schedulers when one runs.
    services = start_services(config.services, reuse=True) if config.services else {}
    if config.services:
        connect()
    try:
        return _recompute(stage, config, env, store, key)
    finally:
        stop_services(services)


def _recompute(stage: str, config: ExperimentConfig, env, store: ExperienceStore,
               key: MicroBatchKey) -> tuple[Path, pa.Table, float]:
    started = time.time()
    if stage == "rollouts":
        table = _rollouts(config, env, store, key)
    elif stage == "environment_results":
        table = execute_micro_batch(env, store.read("rollouts", key), pool=_action_pool(config, env))
    elif stage == "rewards":
        table = score_micro_batch(env, store.read("rollouts", key), store.read("environment_results", key),
                                  config.advantages(), model_reward=_model_reward(config, env, store))
    elif stage == "policy_updates":
        table = _policy_updates(config, env, store, key)
    elif stage == "evaluations":
        table = _evaluations(config, env, store, key.step)
        path = store.commit(stage, key, table)  # not a pipeline stage: no stage timing
        return path, table, time.time() - started
    else:
        raise ValueError(f"unknown stage {stage!r}")
    ended = time.time()
    table = with_stage_timing(table, started, started, ended)  # ready the moment it is asked for
    path = store.commit(stage, key, table)
    return path, table, ended - started


def _action_pool(config: ExperimentConfig, env):
    """The process's shared pool for the run's action settings when Ray is up; None runs the actions in-process."""
    import ray

    settings = action_pool_settings(env, config.environment.pool)
    return shared_pool(settings) if settings is not None and ray.is_initialized() else None


def _model_reward(config: ExperimentConfig, env, store: ExperienceStore):
    """The run's judge, or its reward model loaded in-process (one partition's scoring needs no pool); None
    without either."""
    if config.reward.judge is not None:
        return model_reward(config)
    path = prepare_reward_model(config, env, store)
    if path is None or config.reward_model is None:
        return None
    server = RewardModelServer.from_settings(path, config.reward_model)
    return ModelReward.from_settings(config.reward_model, server.score)


def _policy_versions_at(store: ExperienceStore, config: ExperimentConfig, key: MicroBatchKey,
                        stage: str) -> dict[str, int]:
    """The version each agent's policy had for ``stage`` of ``key``, which must still be stored.

    A trainer takes step ``s``'s gradient at version ``s`` (one optimizer step per step, numbered from 0). A stored
    rollout names the versions that sampled it (older than the step under a staleness bound): a recomputation
    samples from the same ones, the newest of an agent's turns if an update landed mid-micro-batch.
    """
    versions = {agent: key.step for agent in config.agents}
    if stage == "rollouts" and store.is_committed("rollouts", key):
        stored = store.read("rollouts", key, columns=["agent", "policy_version"])
        newest = stored.group_by("agent").aggregate([("policy_version", "max")])
        versions.update(zip(newest.column("agent").to_pylist(), newest.column("policy_version_max").to_pylist()))
    for agent, version in versions.items():
        store.require_policy(config.run, agent, version)
    return versions


@contextmanager
def _engines(config: ExperimentConfig, store: ExperienceStore, versions: dict[str, int]):
    """Engine actors serving ``versions`` for one recomputation, stopped when it ends (kept for the next launch or
    recomputation in this process with ``ray.keep_actors``)."""
    from marl_pipeline.cluster import warm_actors
    from marl_pipeline.cluster.spawn import start_engines

    engines = start_engines(config, store, versions)
    try:
        yield engines
    finally:
        for engine in engines.values():
            warm_actors.release(engine, config.ray.keep_actors)


def _rollouts(config: ExperimentConfig, env, store: ExperienceStore, key: MicroBatchKey) -> pa.Table:
    with _engines(config, store, _policy_versions_at(store, config, key, "rollouts")) as engines:
        return sample_micro_batch(env, engines, key, config)


def _evaluations(config: ExperimentConfig, env, store: ExperienceStore, version: int) -> pa.Table:
    """Every agent's held-out evaluation at policy ``version`` (which every agent must have committed)."""
    if not is_evaluated(env):
        raise ValueError(f"environment {config.environment.name!r} has no evaluation_cases/evaluate")
    for agent in config.agents:
        store.require_policy(config.run, agent, version)
    settings = EvaluationSettings.from_config(config)
    with _engines(config, store, {agent: version for agent in config.agents}) as engines:
        by_role = {role: engines[agent] for role, agent in config.role_agents().items()}
        tables = [evaluate_agent(env, role, engine, settings) for role, engine in by_role.items()]
        table = pa.concat_tables(tables + ([evaluate_team(env, by_role, settings)]
                                           if is_team_evaluated(env, settings) else []))
    return with_metrics(env, table)[0]


def _policy_updates(config: ExperimentConfig, env, store: ExperienceStore, key: MicroBatchKey) -> pa.Table:
    """The micro-batch's gradient statistics at the step's starting policy; no optimizer step is taken."""
    stats = {}
    for agent, version in _policy_versions_at(store, config, key, "policy_updates").items():
        trainer = PolicyTrainer(str(store.require_policy(config.run, agent, version)), version,
                                **with_local_base(store, config.run, agent, trainer_options(config.agent_slice(agent))))
        stats[agent] = trainer.accumulate(train_batch_for(store, key, agent,
                                                          agent in config.dropping_zero_advantage_groups()))
        trainer.discard_gradients()
    return updates_table(stats)
