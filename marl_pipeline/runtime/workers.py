"""Spawning the Ray actors of a run: one rollout engine and one trainer per agent, and the stage pools.

``ray.remote`` is applied here, where actors are spawned, with resources from the config; the engine
and trainer classes stay plain Python and run in-process in a script or a test just as well.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import ray

from marl_pipeline.config import EngineConfig, ExperimentConfig, PoolSettings, TrainerConfig
from marl_pipeline.runtime.action_pool import ActionPool
from marl_pipeline.runtime.async_engine import AsyncRolloutEngine
from marl_pipeline.runtime.engine import ENGINE_ENV, RolloutEngine
from marl_pipeline.runtime.reward_model import RewardModelPool
from marl_pipeline.runtime.trainer import PolicyTrainer
from marl_pipeline.store import ExperienceStore


@dataclass
class Workers:
    """Actor handles of a run, by agent."""

    engines: dict[str, ray.actor.ActorHandle]
    trainers: dict[str, ray.actor.ActorHandle]
    reward_pool: RewardModelPool | None = None
    """Replicas of the run's reward model (None: rule-based reward only)."""
    action_pool: ActionPool | None = None
    """The environment stage's action workers (None: the plugin runs no actions)."""

    def shutdown(self) -> None:
        for handle in [*self.engines.values(), *self.trainers.values()]:
            ray.kill(handle)
        for pool in (self.reward_pool, self.action_pool):
            if pool is not None:
                pool.shutdown()


def shared_threads(num_cpus: float, reserved: list[float], cluster_cpus: float, node_cpus: float) -> int:
    """Threads for an actor reserving ``num_cpus`` when the run's engines and trainers reserve ``reserved``:
    its share of the cluster's CPUs in proportion to its reservation (equal shares when nothing is reserved),
    rounded down, at least 1 and at most one node's CPUs.

    Why not Ray's own rule: Ray gives an actor with fractional ``num_cpus`` one OpenMP thread, so a 0.5-CPU
    trainer on an idle 2-core machine computed on one core (BENCHMARKS.md, "Trainer throughput").
    """
    total = sum(reserved)
    share = num_cpus / total if total > 0 else 1 / max(len(reserved), 1)
    return int(max(1, min(node_cpus, cluster_cpus * share)))


def actor_threads(config: ExperimentConfig, settings: EngineConfig | TrainerConfig) -> int:
    """``settings.threads`` when the config sets it, else :func:`shared_threads` over the running Ray cluster."""
    if settings.threads is not None:
        return settings.threads
    reserved = [part.num_cpus for agent in config.agents.values() for part in (agent.engine, agent.trainer)]
    node_cpus = max((node["Resources"].get("CPU", 0.0) for node in ray.nodes() if node["Alive"]), default=1.0)
    return shared_threads(settings.num_cpus, reserved, ray.cluster_resources().get("CPU", 1.0), node_cpus)


def engine_actor(engine: EngineConfig, asynchronous: bool = False):
    """The Ray actor class of a rollout engine, with the engine's resources and environment: the asynchronous one
    (requests one at a time, for trajectory-level rollout) or the batched one."""
    engine_class = AsyncRolloutEngine if asynchronous else RolloutEngine
    return ray.remote(engine_class).options(name=None, num_cpus=engine.num_cpus, num_gpus=engine.num_gpus,
                                            runtime_env={"env_vars": ENGINE_ENV})


def trainer_actor(trainer: TrainerConfig):
    """The Ray actor class of a policy trainer, with the trainer's resources."""
    return ray.remote(PolicyTrainer).options(num_cpus=trainer.num_cpus, num_gpus=trainer.num_gpus)


def start_engines(config: ExperimentConfig, store: ExperienceStore, versions: dict[str, int]) -> dict:
    """One vLLM engine actor per agent, serving the given policy version from the store."""
    engines = {}
    asynchronous = config.pipeline.rollout.mode == "trajectory"
    for index, (agent, agent_config) in enumerate(config.agents.items()):
        engine = agent_config.engine
        engines[agent] = engine_actor(engine, asynchronous).remote(
            str(store.policy_dir(config.run, agent, versions[agent])), versions[agent],
            gpu_memory_utilization=engine.gpu_memory_utilization, max_model_len=engine.max_model_len,
            dtype=engine.dtype, seed=config.seed + index, threads=actor_threads(config, engine),
        )
    return engines


def trainer_options(config: ExperimentConfig, agent: str, store: ExperienceStore) -> dict:
    """``PolicyTrainer``'s keyword arguments for one agent, cut from its slice of the config (the one place:
    the train job's actors and a recomputed partition's in-process trainer alike). The KL penalty's reference
    is the agent's base policy, version 0 in the store, passed only when the penalty is on. ``num_threads`` is
    the config's ``threads`` (None: the process's own; :func:`start_trainers` fills in the actor's share)."""
    trainer, algorithm = config.agents[agent].trainer, config.algorithm
    index = list(config.agents).index(agent)
    reference_dir = str(store.policy_dir(config.run, agent, 0)) if algorithm.kl_coef > 0 else None
    return dict(lr=trainer.lr, weight_decay=trainer.weight_decay, max_grad_norm=trainer.max_grad_norm,
                clip_eps=algorithm.clip_eps, seed=config.seed + index, num_threads=trainer.threads,
                lr_decay_steps=trainer.lr_decay_steps, min_lr_ratio=trainer.min_lr_ratio,
                kl_coef=algorithm.kl_coef, reference_dir=reference_dir, entropy_coef=algorithm.entropy_coef,
                loss_normalization=algorithm.loss_normalization, tis_cap=algorithm.tis_cap, dtype=trainer.dtype,
                chunk_tokens=trainer.chunk_tokens)


def start_trainers(config: ExperimentConfig, store: ExperienceStore, versions: dict[str, int]) -> dict:
    """One torch trainer actor per agent, starting from the given policy version in the store."""
    trainers = {}
    for agent, agent_config in config.agents.items():
        options = {**trainer_options(config, agent, store), "num_threads": actor_threads(config, agent_config.trainer)}
        trainers[agent] = trainer_actor(agent_config.trainer).remote(
            str(store.policy_dir(config.run, agent, versions[agent])), versions[agent], **options)
    return trainers


START_TIMEOUT_S = 600.0
"""An actor not up by then is reported with what was asked and what the cluster has (no silent hang)."""


def _wait_ready(config: ExperimentConfig, handles: list) -> None:
    try:
        ray.get([h.policy_version.remote() for h in handles], timeout=START_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        asked = {"CPU": sum(a.engine.num_cpus + a.trainer.num_cpus for a in config.agents.values()),
                 "GPU": sum(a.engine.num_gpus + a.trainer.num_gpus for a in config.agents.values())}
        raise TimeoutError(
            f"engines and trainers not ready after {START_TIMEOUT_S:.0f} s: they ask for {asked} in all "
            f"(agents.*.engine/trainer.num_cpus, num_gpus); the Ray cluster has {ray.cluster_resources()} and "
            f"{ray.available_resources()} free. Lower the requests or give Ray more.") from None


def start_workers(config: ExperimentConfig, store: ExperienceStore, versions: dict[str, int],
                  reward_model: Path | None = None, action_pool: PoolSettings | None = None) -> Workers:
    """Engines and trainers of every agent, the reward model's pool and the action pool when the run has them;
    returns once the engines, trainers and reward-model replicas are ready. The pools live as long as the run."""
    workers = Workers(start_engines(config, store, versions), start_trainers(config, store, versions))
    try:
        if action_pool is not None:
            workers.action_pool = ActionPool(action_pool)
        if reward_model is not None and config.reward_model is not None:
            workers.reward_pool = RewardModelPool(reward_model, config.reward_model)
        _wait_ready(config, [*workers.engines.values(), *workers.trainers.values()])
    except BaseException:
        workers.shutdown()
        raise
    return workers
