"""Spawning the Ray actors of a run: rollout engines per agent (``engine.replicas`` of them, each split over
``tensor_parallel_size`` GPUs in a placement group of its own when that is above 1), one trainer per agent (on
``trainer.workers`` actors: cluster/trainers.py; or, with a trainer budget below the number of agents, that many
trainer workers swapping the agents' states: ``training/swap.py``; or, for a hybrid agent, inside its engine replica
0's process: cluster/hybrid.py), and the stage pools.

``ray.remote`` is applied here, where actors are spawned, with resources from the config (``ray.engine_resources``
/ ``ray.trainer_resources`` pin them to the nodes that offer those custom resources); the engine and trainer
classes stay plain Python and run in-process in a script or a test just as well.

An actor may run on another node than the driver, so it is handed the store's settings, not a path: it fetches
the policy version it starts from into its own node's cache (cluster/engines.py, cluster/trainers.py), and a
trainer uploads each new version to the store itself. Weights for an engine's reload go through Ray's object
store (the orchestrator passes the trainer's ``named_weights`` reference to the engine), which Ray moves between
nodes, except where a hybrid agent's process holds them (cluster/engines.py, ``HeldWeights``); the store is the
durable copy, written once per version, read by whoever starts from it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import ray
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from marl_pipeline.actions.pool import ActionPool
from marl_pipeline.bootstrap.policies import BasePolicy, make_on_ray
from marl_pipeline.cluster import colocation, placement, warm_actors
from marl_pipeline.cluster.engines import StoreAsyncEngine
from marl_pipeline.cluster.hybrid import InProcessTrainer, remote_agent_process
from marl_pipeline.cluster.placement import assign_workers, bundle, swapping, trainer_reservations
from marl_pipeline.cluster.trainers import StoreTrainer, remote_trainer, start_sharded_trainer
from marl_pipeline.config import EngineConfig, ExperimentConfig, PoolSettings, StoreConfig, TrainerConfig
from marl_pipeline.inference.engine import ENGINE_ENV, RolloutEngine
from marl_pipeline.inference.replicas import EngineReplicas
from marl_pipeline.inference.reward_model import RewardModelPool
from marl_pipeline.store import ExperienceStore
from marl_pipeline.training.swap import AgentSpec, SwappedTrainer, TrainerWorker, actor_handles
from marl_pipeline.training.trainer import PolicyTrainer


@dataclass
class Workers:
    """Actor handles of a run, by agent."""

    engines: dict[str, EngineReplicas]
    """Each agent's engine replicas (one or more), with their router."""
    trainers: dict[str, ray.actor.ActorHandle | SwappedTrainer | InProcessTrainer]
    """Each agent's trainer actor, or its handle on the trainer worker that swaps it in or on its engine's process
    (same calls)."""
    reward_pool: RewardModelPool | None = None
    """Replicas of the run's reward model (None: rule-based reward only)."""
    action_pool: ActionPool | None = None
    """The environment stage's action workers (None: the plugin runs no actions)."""
    placement_groups: list = field(default_factory=list)
    """Those of the trainers on several workers (removed with the run: their ranks stop)."""
    base_policies: list[BasePolicy] = field(default_factory=list)
    """The versions 0 made as the workers started."""

    def shutdown(self, keep: bool = False) -> None:
        """Stop the run's actors; with ``keep``, leave its engines and resident trainers idle for the next launch
        in this process instead (``ray.keep_actors``, cluster/warm_actors.py)."""
        for replicas in self.engines.values():
            replicas.shutdown(keep)
        # swapped trainers' workers are never kept (not started through warm_actors); in-process ones go with their
        # engines
        for handle in actor_handles({a: t for a, t in self.trainers.items() if not isinstance(t, InProcessTrainer)}):
            warm_actors.release(handle, keep)
        for group in self.placement_groups:
            ray.util.remove_placement_group(group)
        for pool in (self.reward_pool, self.action_pool):
            if pool is not None:
                pool.shutdown()


def actor_threads(config: ExperimentConfig, settings: EngineConfig | TrainerConfig) -> int:
    """The actor's threads (:func:`placement.actor_threads`) over the running Ray cluster."""
    node_cpus = max((node["Resources"].get("CPU", 0.0) for node in ray.nodes() if node["Alive"]), default=1.0)
    return placement.actor_threads(config, settings, ray.cluster_resources().get("CPU", 1.0), node_cpus)


def engine_actor(engine: EngineConfig, resources: dict[str, float] | None = None,
                 actor_class: type = RolloutEngine):
    """The Ray actor class of a rollout engine, with the engine's resources (custom ones pin it to the nodes that
    have them) and environment; :class:`StoreAsyncEngine` for a run's engines, ``AsyncRolloutEngine`` or the
    batched ``RolloutEngine`` from a path (tests, benchmarks)."""
    return ray.remote(actor_class).options(name=None, num_cpus=engine.num_cpus, num_gpus=engine.num_gpus,
                                           resources=dict(resources or {}), runtime_env={"env_vars": ENGINE_ENV})


def trainer_actor(trainer: TrainerConfig, resources: dict[str, float] | None = None,
                  actor_class: type = PolicyTrainer):
    """The Ray actor class of a policy trainer, with the trainer's resources (as :func:`engine_actor`)."""
    return remote_trainer(actor_class).options(num_cpus=trainer.num_cpus, num_gpus=trainer.num_gpus,
                                               resources=dict(resources or {}))


def start_engines(config: ExperimentConfig, store: ExperienceStore, versions: dict[str, int]) -> dict:
    """One vLLM engine actor per agent whatever ``engine.replicas`` says (a recomputation, a test), serving the given
    policy version from the store."""
    engines = {agent: replicas.handle(0)
               for agent, replicas in start_engine_replicas(config, store, versions, replicas=1).items()}
    warm_actors.stop_idle()  # kept actors not taken would hold CPUs the new engines wait for
    return engines


def start_engine_replicas(config: ExperimentConfig, store: ExperienceStore, versions: dict[str, int],
                          replicas: int | None = None, after: dict[str, list] | None = None,
                          shared: dict[str, PlacementGroup] | None = None,
                          first: dict | None = None) -> dict[str, EngineReplicas]:
    """Each agent's engine replicas (``agents.<name>.engine.replicas``, or ``replicas`` for every agent), serving the
    given policy version from the store once ``after[agent]`` is ready (see ``StoreAsyncEngine``); a replica that
    dies is restarted the same way (inference/replicas.py). ``shared``: the placement groups of the agents whose
    engine and trainer share GPUs (cluster/colocation.py); ``first``: replica 0 of the agents that have it started
    already (the hybrid agents' processes, cluster/hybrid.py)."""
    after, shared, first = after or {}, shared or {}, first or {}
    rebalance = config.pipeline.rollout.rebalance_replicas
    budget = sum(agent.engine.replicas for agent in config.agents.values())
    sets = {}
    for agent, agent_config in config.agents.items():
        engine = agent_config.engine
        actor = engine_actor(engine, config.ray.engine_resources, StoreAsyncEngine)
        options = engine_options(config, agent)
        # What a kept engine must have been started with to be taken instead of a new one (warm_actors.py).
        settings = ("engine", StoreAsyncEngine.__name__, engine.num_cpus, engine.num_gpus,
                    tuple(sorted(config.ray.engine_resources.items())), tuple(sorted(options.items())))
        spawn = partial(_spawn_engine, actor, settings, store.config, config.run, agent, options)
        release = warm_actors.release
        if agent in shared:  # never kept: it holds a share of its agent's GPUs
            spawn = partial(colocation.spawn_engine, actor, agent_config, shared[agent], store.config, config.run,
                            agent, options)
            release = colocation.release_engine
        elif engine.tensor_parallel_size > 1:
            groups: dict = {}
            spawn = partial(_spawn_split_engine, actor, engine, config.ray.engine_resources, groups, store.config,
                            config.run, agent, options)
            release = partial(_release_split_engine, groups)
        # With rebalancing, any agent may come to hold every replica but one per other agent.
        capacity = (budget - len(config.agents) + 1) if rebalance and replicas is None else None
        started = [first[agent]] if agent in first else []
        started += [spawn(k, versions[agent], after=after.get(agent))
                    for k in range(len(started), replicas or engine.replicas)]
        sets[agent] = EngineReplicas(agent, started,
                                     versions[agent], spawn, engine.max_outstanding, capacity=capacity,
                                     release=release)
    return sets


def engine_options(config: ExperimentConfig, agent: str) -> dict:
    """The keyword arguments of an agent's engine actors (``StoreAsyncEngine``) beside the store and version."""
    agent_config = config.agents[agent]
    engine = agent_config.engine
    return dict(gpu_memory_utilization=engine.gpu_memory_utilization, max_model_len=engine.max_model_len,
                dtype=engine.dtype, seed=config.seed + list(config.agents).index(agent),
                threads=actor_threads(config, engine), kv_cache_gib=engine.kv_cache_gib,
                tensor_parallel_size=engine.tensor_parallel_size, sleep_mode=agent_config.colocated)


def _spawn_engine(actor, settings: tuple, store: StoreConfig, run: str, agent: str, options: dict, replica: int,
                  version: int, after: list | None = None):
    """One engine replica from the store (the replica index only names it: replicas are alike): a kept one
    restarted at ``version``, else a new one."""
    return warm_actors.start(actor, settings, store, run, agent, version, after=after, **options)


def split_engine_bundles(engine: EngineConfig, resources: dict[str, float]) -> list[dict[str, float]]:
    """The placement group of a replica split over ``tensor_parallel_size`` GPUs: one GPU per rank, the engine
    actor's CPUs (and custom resources) beside the first."""
    return [bundle(engine.num_cpus, 1.0, resources)] + [bundle(0, 1.0, {})] * (engine.tensor_parallel_size - 1)


def split_engine_options(engine: EngineConfig, group) -> dict:
    """The engine actor's options in its placement group: no GPU of its own (vLLM's Ray workers take the bundles'
    GPUs, as children of the actor placed in the group), its CPUs in bundle 0."""
    return dict(num_gpus=0, num_cpus=engine.num_cpus, scheduling_strategy=PlacementGroupSchedulingStrategy(
        group, placement_group_bundle_index=0, placement_group_capture_child_tasks=True))


def _spawn_split_engine(actor, engine: EngineConfig, resources: dict[str, float], groups: dict, store: StoreConfig,
                        run: str, agent: str, options: dict, replica: int, version: int, after: list | None = None):
    """A replica over several GPUs of one node, in a placement group of its own; never kept (it holds whole GPUs)."""
    group = ray.util.placement_group(split_engine_bundles(engine, resources), strategy="STRICT_PACK")
    handle = actor.options(**split_engine_options(engine, group)).remote(store, run, agent, version, after=after,
                                                                         **options)
    groups[handle._actor_id] = group
    return handle


def _release_split_engine(groups: dict, handle, keep: bool) -> None:
    ray.kill(handle)
    if (group := groups.pop(handle._actor_id, None)) is not None:
        ray.util.remove_placement_group(group)


def trainer_options(config: ExperimentConfig, agent: str, store: ExperienceStore) -> dict:
    """``PolicyTrainer``'s keyword arguments for one agent, cut from its slice of the config (the one place:
    the train job's actors and a recomputed partition's in-process trainer alike). The KL penalty's reference
    is the agent's base policy, version 0 in the store, passed only when the penalty is on; so is a LoRA agent's
    ``base_dir``, what its adapters are added to (policy/lora.py). ``num_threads`` is
    the config's ``threads`` (None: the process's own; :func:`start_trainers` fills in the actor's share)."""
    trainer, algorithm = config.agents[agent].trainer, config.algorithm
    index = list(config.agents).index(agent)
    base_dir = str(store.policy_dir(config.run, agent, 0))
    reference_dir = base_dir if algorithm.kl_coef > 0 else None
    lora = config.agents[agent].lora
    return dict(lr=trainer.lr, weight_decay=trainer.weight_decay, max_grad_norm=trainer.max_grad_norm,
                clip_eps=algorithm.clip_eps, seed=config.seed + index, num_threads=trainer.threads,
                lr_decay_steps=trainer.lr_decay_steps, min_lr_ratio=trainer.min_lr_ratio,
                kl_coef=algorithm.kl_coef, reference_dir=reference_dir, entropy_coef=algorithm.entropy_coef,
                loss_normalization=algorithm.loss_normalization, tis_cap=algorithm.tis_cap, dtype=trainer.dtype,
                chunk_tokens=trainer.chunk_tokens, lora=None if lora is None else lora.model_dump(),
                base_dir=None if lora is None else base_dir, activation_checkpointing=trainer.activation_checkpointing)


def start_trainers(config: ExperimentConfig, store: ExperienceStore, versions: dict[str, int],
                   placement_groups: list | None = None, prepare: dict[str, Callable] | None = None,
                   shared: dict[str, PlacementGroup] | None = None) -> dict:
    """One torch trainer actor per agent (rank 0 of ``trainer.workers``, its placement group appended to
    ``placement_groups``), starting from the given policy version in the store, which ``prepare[agent]`` makes
    first in the actor where it is missing; with a trainer budget below the number of agents, that many trainer
    workers, each serving its agents by swapping (nothing to prepare: see :func:`start_workers`). ``shared`` as for
    :func:`start_engine_replicas`."""
    prepare, shared = prepare or {}, shared or {}
    if swapping(config):
        if prepare:
            raise ValueError(f"swapped trainers cannot prepare version 0 of {sorted(prepare)}: make it first")
        return start_swapped_trainers(config, store, versions)
    trainers = {}
    for agent, agent_config in config.agents.items():
        trainer = agent_config.trainer
        options = {**trainer_options(config, agent, store), "num_threads": actor_threads(config, trainer),
                   "prepare": prepare.get(agent)}
        if agent_config.hybrid:  # in replica 0 of the agent's engines (cluster/hybrid.py); never kept
            trainers[agent] = InProcessTrainer(start_agent_process(config, store, agent, versions[agent], options))
            continue
        if agent in shared and trainer.workers == 1:  # never kept: it holds a share of its agent's GPU
            trainers[agent] = colocation.start_trainer(agent_config, shared[agent], store.config, config.run, agent,
                                                       versions[agent], **options)
            continue
        if trainer.workers > 1:  # never kept: its ranks meet once, in a placement group of their own
            if placement_groups is None:
                raise ValueError(f"{agent} trains on {trainer.workers} workers: pass placement_groups, to remove "
                                 f"theirs with the run")
            if agent in shared:  # each rank on half of one of the GPUs it shares with the engine
                trainer = trainer.model_copy(update={"num_gpus": colocation.SHARE})
            trainers[agent], group = start_sharded_trainer(trainer, config.ray.trainer_resources, store.config,
                                                           config.run, agent, versions[agent], group=shared.get(agent),
                                                           **options)
            if agent not in shared:  # a shared group is already the run's (start_workers)
                placement_groups.append(group)
            continue
        # A kept trainer is rebuilt whatever its options were (PolicyTrainer.restart): only its resources must match.
        settings = ("trainer", trainer.num_cpus, trainer.num_gpus, tuple(sorted(config.ray.trainer_resources.items())))
        trainers[agent] = warm_actors.start(trainer_actor(trainer, config.ray.trainer_resources, StoreTrainer),
                                            settings, store.config, config.run, agent, versions[agent], **options)
    return trainers


def start_agent_process(config: ExperimentConfig, store: ExperienceStore, agent: str, version: int,
                        trainer: dict):
    """A hybrid agent's engine replica 0 with its trainer inside (``trainer``: the trainer actor's arguments),
    reserving what the two would (custom resources added up)."""
    agent_config, ray_config = config.agents[agent], config.ray
    resources = {name: ray_config.engine_resources.get(name, 0.0) + ray_config.trainer_resources.get(name, 0.0)
                 for name in {*ray_config.engine_resources, *ray_config.trainer_resources}}
    return remote_agent_process().options(
        num_cpus=agent_config.engine.num_cpus + agent_config.trainer.num_cpus, resources=resources,
        runtime_env={"env_vars": ENGINE_ENV}).remote(store.config, config.run, agent, version, trainer=trainer,
                                                     **engine_options(config, agent))


def start_swapped_trainers(config: ExperimentConfig, store: ExperienceStore, versions: dict[str, int]) -> dict:
    """``ray.resident_trainers`` trainer workers, each reserving the largest agent's trainer request (a worker
    must hold any of its agents), agent i served by worker i mod N."""
    served = assign_workers(list(config.agents), config.ray.resident_trainers)
    requests = [agent.trainer for agent in config.agents.values()]
    # as the placement plan reserves it: the largest CPU and the largest GPU request, the most threads asked for
    explicit = [t.threads for t in requests if t.threads is not None]
    settings = requests[0].model_copy(update={"num_cpus": trainer_reservations(config, "cpus")[0],
                                              "num_gpus": trainer_reservations(config, "gpus")[0],
                                              "threads": max(explicit) if explicit else None})
    threads = actor_threads(config, settings)
    trainers = {}
    for worker in range(config.ray.resident_trainers):
        agents = {agent: AgentSpec(str(store.policy_dir(config.run, agent, versions[agent])), versions[agent],
                                   {**trainer_options(config, agent, store), "num_threads": threads})
                  for agent, k in served.items() if k == worker}
        handle = ray.remote(TrainerWorker).options(
            num_cpus=settings.num_cpus, num_gpus=settings.num_gpus, resources=dict(config.ray.trainer_resources),
        ).remote(agents, partial(_store_trainer, store.config, config.run))
        trainers |= {agent: SwappedTrainer(handle, agent) for agent in agents}
    return {agent: trainers[agent] for agent in config.agents}


def _store_trainer(store: StoreConfig, run: str, agent: str, spec: AgentSpec) -> StoreTrainer:
    """How a trainer worker builds a swapped agent's trainer: as a resident one is built, from the store."""
    return StoreTrainer(store, run, agent, spec.version, **spec.options)


START_TIMEOUT_S = 600.0
"""An actor not up by then is reported with what was asked and what the cluster has (no silent hang)."""


def _wait_ready(config: ExperimentConfig, handles: dict[str, object]) -> Iterator[str]:
    """Each of ``handles``' names (label: actor) as its actor is up, in the order they come up; an actor that failed
    to start raises here, one not up after ``START_TIMEOUT_S`` raises a TimeoutError with the arithmetic."""
    pending = {handle.policy_version.remote(): name for name, handle in handles.items()}
    deadline = time.monotonic() + START_TIMEOUT_S
    while pending:
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            asked = {resource: sum(getattr(a.engine, f"num_{resource.lower()}s") * a.engine.replicas
                                   for a in config.agents.values())
                     + sum(trainer_reservations(config, f"{resource.lower()}s")) for resource in ("CPU", "GPU")}
            raise TimeoutError(
                f"{', '.join(sorted(pending.values()))} not ready after {START_TIMEOUT_S:.0f} s: engines and "
                f"trainers ask for {asked} in all (agents.*.engine/trainer.num_cpus, num_gpus); the Ray cluster has "
                f"{ray.cluster_resources()} and {ray.available_resources()} free. Lower the requests or give Ray more.")
        ray.get(ready)  # an actor that failed to start raises its error
        yield pending.pop(ready[0])


def start_workers(config: ExperimentConfig, store: ExperienceStore, versions: dict[str, int],
                  reward_model: Path | None = None, action_pool: PoolSettings | None = None,
                  prepare: dict[str, Callable] | None = None) -> Generator[str, None, Workers]:
    """Engines and trainers of every agent, the reward model's pool and the action pool when the run has them;
    yields each engine's and trainer's name as it is up (the launch's progress) and returns once all of them and
    the reward-model replicas are ready. The pools live as long as the run.

    ``prepare``: makers of the versions 0 missing from the store (bootstrap/policies.py: ``base_policy_makers``),
    run in the agents' trainer actors while their engines import vLLM, or in Ray tasks first where trainers swap
    (a swapped agent's trainer is built on its first call); what they made is in ``Workers.base_policies``."""
    prepare, made = dict(prepare or {}), []
    if swapping(config) and prepare:
        warm_actors.stop_idle()  # the tasks reserve trainer CPUs: kept idle actors would hold them for ever
        made, prepare = make_on_ray(config, prepare), {}
    shared = {agent: colocation.colocation_group(agent_config, config.ray.engine_resources,
                                                 config.ray.trainer_resources)
              for agent, agent_config in config.agents.items() if colocation.shares_gpus(agent_config)}
    groups: list = list(shared.values())
    workers = Workers({}, start_trainers(config, store, versions, groups, prepare, shared), placement_groups=groups)
    try:
        after = {agent: [workers.trainers[agent].base_policy.remote()] for agent in prepare}
        in_process = {agent: trainer.actor for agent, trainer in workers.trainers.items()
                      if isinstance(trainer, InProcessTrainer)}
        workers.engines = start_engine_replicas(config, store, versions, after=after, shared=shared,
                                                first=in_process)
        if action_pool is not None:
            workers.action_pool = ActionPool(action_pool)
        if reward_model is not None and config.reward_model is not None:
            workers.reward_pool = RewardModelPool(reward_model, config.reward_model)
        # Kept actors this launch did not take would hold CPUs its new ones wait for.
        warm_actors.stop_idle()
        actors = {f"trainer of {agent}": handle for agent, handle in workers.trainers.items()}
        for agent, replicas in workers.engines.items():
            handles = replicas.handles()
            actors |= {f"engine of {agent}" + (f" #{k}" if len(handles) > 1 else ""): handle
                       for k, handle in enumerate(handles)}
        yield from _wait_ready(config, actors)  # a trainer that fails preparing version 0 fails the launch then
        workers.base_policies = made + ray.get([refs[0] for refs in after.values()])
    except BaseException:
        workers.shutdown()
        raise
    return workers
