"""Spawning the Ray actors of a run from the placement plan's specs (cluster/specs.py), never from the experiment:
rollout engines per agent (each replica split over several GPUs in a placement group of its own when its spec says
so), one trainer per agent (on several ranks in a group: cluster/trainers.py; or trainer workers swapping the agents'
states: ``training/swap.py``; or, for a hybrid agent, inside its engine replica 0's process: cluster/hybrid.py), and
the stage pools.

``ray.remote`` is applied here, where actors are spawned, with the spec's resources (cluster/options.py); the
engine and trainer classes stay plain Python and run in-process in a script or a test just as well.

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
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path

import ray
from ray.util.placement_group import PlacementGroup

from marl_pipeline.actions.pool import ActionPool
from marl_pipeline.bootstrap.policies import BasePolicy, make_on_ray
from marl_pipeline.cluster import warm_actors
from marl_pipeline.cluster.engines import StoreAsyncEngine
from marl_pipeline.cluster.hybrid import AgentProcess, InProcessTrainer, remote_agent_process
from marl_pipeline.cluster.options import actor_options, placement_group
from marl_pipeline.cluster.placement import PlacementPlan, plan_placement
from marl_pipeline.cluster.specs import ActorSpec
from marl_pipeline.cluster.trainers import ShardedTrainer, StoreTrainer, remote_trainer
from marl_pipeline.config import (
    EngineConfig,
    ExperimentConfig,
    PoolSettings,
    RewardModelConfig,
    StoreConfig,
    TrainerConfig,
)
from marl_pipeline.inference.engine import ENGINE_ENV, RolloutEngine
from marl_pipeline.inference.replicas import EngineReplicas
from marl_pipeline.inference.reward_model import RewardModelPool
from marl_pipeline.services.scheduler import stop_services
from marl_pipeline.store import ExperienceStore
from marl_pipeline.training.swap import AgentSpec, SwappedTrainer, TrainerWorker, actor_handles
from marl_pipeline.training.trainer import PolicyTrainer

TRAINER, SHARDED = "trainer", "sharded trainer"
"""The kinds of kept trainers (warm_actors.py: the first item of their settings); a hybrid agent's process is kept
as an engine (``AgentProcess``)."""


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
    """The colocated agents' groups, each shared by an agent's engine and trainer ranks (removed with the run; a
    sharded trainer's own group goes with its rank 0, cluster/warm_actors.py)."""
    base_policies: list[BasePolicy] = field(default_factory=list)
    """The versions 0 made as the workers started."""
    services: dict[str, ray.actor.ActorHandle] = field(default_factory=dict)
    """The schedulers of the run's external services, by name (services/scheduler.py)."""
    placement: PlacementPlan | None = None
    """The plan the actors were started from: what the run-time reads of them (hand-overs, the core split)."""

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
        stop_services(self.services)


def plan_on_ray(config: ExperimentConfig) -> PlacementPlan:
    """The run's placement plan (cluster/placement.py) on the Ray cluster this process is connected to."""
    return plan_placement(config, [node["Resources"] for node in ray.nodes() if node["Alive"]])


def engine_actor(engine: EngineConfig, resources: dict[str, float] | None = None,
                 actor_class: type = RolloutEngine):
    """The Ray actor class of one rollout engine outside a run (tests, benchmarks): ``actor_class`` (``RolloutEngine``
    or ``AsyncRolloutEngine``, from a path) with the engine's resources and environment."""
    return ray.remote(actor_class).options(name=None, num_cpus=engine.num_cpus, num_gpus=engine.num_gpus,
                                           resources=dict(resources or {}), runtime_env={"env_vars": ENGINE_ENV})


def trainer_actor(trainer: TrainerConfig, resources: dict[str, float] | None = None,
                  actor_class: type = PolicyTrainer):
    """The Ray actor class of one policy trainer outside a run (as :func:`engine_actor`)."""
    return remote_trainer(actor_class).options(num_cpus=trainer.num_cpus, num_gpus=trainer.num_gpus,
                                               resources=dict(resources or {}))


def start_engines(config: ExperimentConfig, store: ExperienceStore, versions: dict[str, int],
                  sources: dict[str, str] | None = None) -> dict:
    """One engine actor per agent serving the given policy version from the store, alone (a recomputation, an
    evaluation): one replica, on GPUs of its own (no trainer to share them with). ``sources``: the agents whose
    stored policy serves another's role (a cast, run/casts.py); by default each its own."""
    agents = {agent: agent_config.model_copy(update={
        "engine": agent_config.engine.model_copy(update={"replicas": 1}), "colocated": False})
        for agent, agent_config in config.agents.items()}
    plan = plan_on_ray(config.model_copy(update={"agents": agents}))
    engines = {agent: replicas.handle(0)
               for agent, replicas in start_engine_replicas(plan, store, versions, sources=sources).items()}
    if not all(warm_actors.taken_idle(engine) for engine in engines.values()):
        warm_actors.stop_idle()  # kept actors not taken would hold CPUs the new engines wait for
    return engines  # all of them taken idle: the other idle actors (trainers) stay for the next launch


def start_engine_replicas(plan: PlacementPlan, store: ExperienceStore, versions: dict[str, int],
                          after: dict[str, list] | None = None, groups: dict[str, PlacementGroup] | None = None,
                          first: dict | None = None, sources: dict[str, str] | None = None
                          ) -> dict[str, EngineReplicas]:
    """Each agent's engine replicas as the plan's specs say, serving the given policy version from the store once
    ``after[agent]`` is ready (see ``StoreAsyncEngine``); a replica that dies is restarted from its spec
    (inference/replicas.py). ``groups``: the placement groups the agents' engines share with their trainers
    (colocated); ``first``: replica 0 of the agents that have it started already (the hybrid agents' processes);
    ``sources``: per agent, the agent whose stored policy its engines serve (default: its own)."""
    after, groups, first = after or {}, groups or {}, first or {}
    sets = {}
    for agent, engine_set in plan.engine_sets.items():
        specs = plan.agent_specs(agent, "engine")
        own: dict = {}  # a split replica's actor id -> its placement group, removed with it
        spawn = partial(_spawn_engine, specs, groups.get(agent), own, store.config, plan.run,
                        (sources or {}).get(agent, agent))
        started = [first[agent]] if agent in first else []
        started += [spawn(k, versions[agent], after=after.get(agent)) for k in range(len(started), len(specs))]
        sets[agent] = EngineReplicas(agent, started, versions[agent], spawn, engine_set.max_outstanding,
                                     capacity=engine_set.capacity, release=partial(_release_engine, own))
    return sets


def _spawn_engine(specs: list[ActorSpec], shared: PlacementGroup | None, own: dict, store: StoreConfig, run: str,
                  source: str, replica: int, version: int, after: list | None = None):
    """Replica slot ``replica`` from its spec (a slot beyond the planned ones, with rebalancing, as the last; a hybrid
    process's slot as its engine alone), serving ``source``'s stored policy at ``version``: a kept one restarted,
    else a new one."""
    spec = specs[min(replica, len(specs) - 1)]
    spec = spec.parts[0] if spec.parts else spec
    actor = ray.remote(StoreAsyncEngine)
    arguments = (store, run, source, version)
    if spec.group is None:
        settings, prefer = _kept_engine(StoreAsyncEngine, spec, spec.options, source)
        return warm_actors.start(actor.options(**actor_options(spec)), settings, *arguments, after=after,
                                 prefer=prefer, held_cpus=spec.cpus, **spec.options)
    group = placement_group(spec.group) if spec.group.kind == "engine" else shared  # a split replica's own
    handle = actor.options(**actor_options(spec, group)).remote(*arguments, after=after, **spec.options)
    if group is not shared:
        own[handle._actor_id] = group
    return handle


@dataclass(frozen=True)
class _NewShardedTrainer:
    """How :func:`warm_actors.start` starts a sharded trainer none was kept for: its rank 0 in a placement group of
    its own, which goes with it."""

    spec: ActorSpec
    """Rank 0's."""

    def remote(self, ranks: list[ActorSpec], *arguments, **options):
        group = placement_group(self.spec.group)
        handle = remote_trainer(ShardedTrainer).options(**actor_options(self.spec, group)).remote(
            ranks, group, *arguments, **options)
        warm_actors.hold_group(handle, group)
        return handle


def _kept_engine(actor_class: type, spec: ActorSpec, engine: dict, source: str) -> tuple[tuple, tuple]:
    """What an engine's process (``actor_class`` from ``spec``, its engine built with the options ``engine``) must have
    been started with to be taken kept instead of a new one (warm_actors.py: ``settings``): its resources (at most its
    CPUs), threads and ranks; it serves another model or other settings by rebuilding its engine in place
    (RolloutEngine.restart), or refuses and is replaced. And the ``prefer`` of one serving ``source`` with the same
    options, which reloads its weights where another would rebuild."""
    settings = (actor_class.__name__, spec.gpus, tuple(sorted(spec.resources.items())), engine.get("threads"),
                engine.get("tensor_parallel_size", 1))
    return settings, (source, tuple(sorted(engine.items())))


def _release_engine(own: dict, handle, keep: bool) -> None:
    """Let go of a replica: kept idle for the next launch if it was started to be (no group), else stopped, and a
    split replica's group removed."""
    group = own.pop(handle._actor_id, None)
    warm_actors.release(handle, keep and group is None)
    if group is not None:
        ray.util.remove_placement_group(group)


def start_trainers(plan: PlacementPlan, store: ExperienceStore, versions: dict[str, int],
                   prepare: dict[str, Callable] | None = None, groups: dict[str, PlacementGroup] | None = None) -> dict:
    """Each agent's trainer as the plan's specs say, starting from the given policy version in the store, which
    ``prepare[agent]`` makes first in the actor where it is missing: its own actor, its ranks (rank 0 returned, its
    placement group going with it: ``warm_actors.release`` removes it), its engine's process, or the trainer worker
    swapping it (nothing to prepare: see :func:`start_workers`). ``groups`` as for :func:`start_engine_replicas`."""
    prepare, groups = prepare or {}, groups or {}
    if plan.trainer_workers:
        if prepare:
            raise ValueError(f"swapped trainers cannot prepare version 0 of {sorted(prepare)}: make it first")
        return start_swapped_trainers(plan, store, versions)
    trainers = {}
    for agent in plan.engine_sets:
        ranks, version = plan.agent_specs(agent, "trainer"), versions[agent]
        spec = ranks[0]
        if spec.role == "agent-process":  # in replica 0 of the agent's engines (cluster/hybrid.py)
            engine, trainer = spec.parts
            # kept as an engine is; its trainer is rebuilt whatever its options were
            settings, prefer = _kept_engine(AgentProcess, spec, engine.options, agent)
            handle = warm_actors.start(
                remote_agent_process().options(**actor_options(spec)), settings, store.config, plan.run, agent,
                version, trainer={**trainer.options, "prepare": prepare.get(agent)}, prefer=prefer,
                held_cpus=spec.cpus, **engine.options)
            trainers[agent] = InProcessTrainer(handle)
            continue
        options = {**spec.options, "prepare": prepare.get(agent)}
        arguments = (store.config, plan.run, agent, version)
        if len(ranks) > 1 and agent in groups:  # never kept: its ranks share their agent's GPUs (colocated)
            trainers[agent] = remote_trainer(ShardedTrainer).options(**actor_options(spec, groups[agent])).remote(
                ranks, groups[agent], *arguments, **options)
        elif len(ranks) > 1:  # kept with the placement group of its own its ranks run in, as one
            settings = (SHARDED, tuple((r.cpus, r.gpus, tuple(sorted(r.resources.items()))) for r in ranks))
            trainers[agent] = warm_actors.start(_NewShardedTrainer(spec), settings, ranks, *arguments,
                                                held_cpus=spec.cpus, **options)
        elif spec.group is not None:  # never kept: it holds a share of its agent's GPU
            trainers[agent] = remote_trainer(StoreTrainer).options(**actor_options(spec, groups[agent])).remote(
                *arguments, **options)
        else:  # a kept trainer is rebuilt whatever its options were (PolicyTrainer.restart): only its resources match
            settings = (TRAINER, spec.gpus, tuple(sorted(spec.resources.items())))
            trainers[agent] = warm_actors.start(remote_trainer(StoreTrainer).options(**actor_options(spec)),
                                                settings, *arguments, held_cpus=spec.cpus, **options)
    return trainers


def start_swapped_trainers(plan: PlacementPlan, store: ExperienceStore, versions: dict[str, int]) -> dict:
    """The plan's trainer workers, each serving its agents by swapping their states (training/swap.py)."""
    trainers = {}
    for spec in (spec for spec in plan.specs if spec.role == "trainer-worker"):
        agents = {agent: AgentSpec(str(store.policy_dir(plan.run, agent, versions[agent])), versions[agent],
                                   spec.options[agent]) for agent in spec.loads}
        handle = ray.remote(TrainerWorker).options(**actor_options(spec)).remote(
            agents, partial(_store_trainer, store.config, plan.run))
        trainers |= {agent: SwappedTrainer(handle, agent) for agent in agents}
    return {agent: trainers[agent] for agent in plan.engine_sets}


def _store_trainer(store: StoreConfig, run: str, agent: str, spec: AgentSpec) -> StoreTrainer:
    """How a trainer worker builds a swapped agent's trainer: as a resident one is built, from the store."""
    return StoreTrainer(store, run, agent, spec.version, **spec.options)


START_TIMEOUT_S = 600.0
"""An actor not up by then is reported with what was asked and what the cluster has (no silent hang)."""


def _wait_ready(plan: PlacementPlan, handles: dict[str, object]) -> Iterator[str]:
    """Each of ``handles``' names (label: actor) as its actor is up, in the order they come up; an actor that failed
    to start raises here, one not up after ``START_TIMEOUT_S`` raises a TimeoutError with the arithmetic."""
    pending = {handle.policy_version.remote(): name for name, handle in handles.items()}
    deadline = time.monotonic() + START_TIMEOUT_S
    while pending:
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            raise TimeoutError(
                f"{', '.join(sorted(pending.values()))} not ready after {START_TIMEOUT_S:.0f} s: the plan reserves "
                f"{plan.summary()['total']} (agents.*.engine/trainer.num_cpus, num_gpus); the Ray cluster has "
                f"{ray.cluster_resources()} and {ray.available_resources()} free. Lower the requests or give Ray more.")
        ray.get(ready)  # an actor that failed to start raises its error
        yield pending.pop(ready[0])


def start_workers(plan: PlacementPlan, store: ExperienceStore, versions: dict[str, int],
                  reward_model: Path | None = None, reward_settings: RewardModelConfig | None = None,
                  action_pool: PoolSettings | None = None,
                  prepare: dict[str, Callable] | None = None) -> Generator[str, None, Workers]:
    """Engines and trainers of every agent as the plan's specs say, the reward model's pool and the action pool when
    the run has them; yields each engine's and trainer's name as it is up (the launch's progress) and returns once
    all of them and the reward-model replicas are ready. The pools live as long as the run.

    ``prepare``: makers of the versions 0 missing from the store (bootstrap/policies.py: ``base_policy_makers``),
    run in the agents' trainer actors while their engines import vLLM, or in Ray tasks first where trainers swap
    (a swapped agent's trainer is built on its first call); what they made is in ``Workers.base_policies``."""
    prepare, made = dict(prepare or {}), []
    if plan.trainer_workers and prepare:
        warm_actors.stop_idle()  # the tasks reserve trainer CPUs: kept idle actors would hold them for ever
        workers = {agent: spec for spec in plan.specs if spec.role == "trainer-worker" for agent in spec.loads}
        made, prepare = make_on_ray(prepare, {agent: actor_options(replace(workers[agent], env={}))
                                              for agent in prepare}), {}
    shared = {}  # each colocated agent's group, made once from the spec its engine and trainer ranks name
    for spec in plan.specs:
        if spec.group is not None and spec.group.kind == "colocated" and spec.agent not in shared:
            shared[spec.agent] = placement_group(spec.group)
    groups: list = list(shared.values())
    workers = Workers({}, start_trainers(plan, store, versions, prepare, shared), placement_groups=groups,
                      placement=plan)
    # Kept trainers and agents' processes this launch did not take (nothing takes one after this) would hold CPUs its
    # new trainers wait for, and the kept engines' restarts below wait for those trainers' versions 0.
    warm_actors.stop_idle((TRAINER, SHARDED, AgentProcess.__name__))
    try:
        after = {agent: [workers.trainers[agent].base_policy.remote()] for agent in prepare}
        in_process = {agent: trainer.actor for agent, trainer in workers.trainers.items()
                      if isinstance(trainer, InProcessTrainer)}
        workers.engines = start_engine_replicas(plan, store, versions, after=after, groups=shared, first=in_process)
        if action_pool is not None:
            workers.action_pool = ActionPool(action_pool)
        if reward_model is not None and reward_settings is not None:
            workers.reward_pool = RewardModelPool(reward_model, reward_settings)
        # Kept actors this launch did not take would hold CPUs its new ones wait for.
        warm_actors.stop_idle()
        actors = {f"trainer of {agent}": handle for agent, handle in workers.trainers.items()}
        for agent, replicas in workers.engines.items():
            handles = replicas.handles()
            actors |= {f"engine of {agent}" + (f" #{k}" if len(handles) > 1 else ""): handle
                       for k, handle in enumerate(handles)}
        yield from _wait_ready(plan, actors)  # a trainer that fails preparing version 0 fails the launch then
        workers.base_policies = made + ray.get([refs[0] for refs in after.values()])
    except BaseException:
        workers.shutdown()
        raise
    return workers
