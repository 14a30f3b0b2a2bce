"""One spec per actor of a run: what the placement plan (placement.py) emits, what spawn.py starts and what the
planner simulates. A spec holds everything its actor is started with, cut from the agent's slice of the config
once: its role, agent and rank, its Ray resources and its place in a placement group, its threads, its
environment, what it loads and its class's keyword arguments. Nothing below the plan reads the experiment.

Pure data and arithmetic: no Ray, torch or vLLM here, so a plan is made (and simulated) without a cluster.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from marl_pipeline.config import AgentConfig, AgentSlice, EngineConfig, RayConfig, TrainerConfig
from marl_pipeline.inference.engine import ENGINE_ENV

Role = Literal["engine", "trainer", "trainer-worker", "agent-process"]
"""An engine replica; a trainer rank; a trainer worker swapping several agents' trainers (training/swap.py); a
hybrid agent's engine replica 0 with its trainer inside (cluster/hybrid.py)."""
SHARE = 0.5
"""Of each GPU an agent's engine and trainer share (``agents.<a>.colocated``), what each rank on it reserves."""
BASE_POLICY = "version 0"
"""In a trainer's options, the agent's version 0 (its KL reference, a LoRA agent's base), fetched on the node the
trainer is built on (cluster/trainers.py, ``with_local_base``)."""


WORKER = "trainer-worker-{}"
"""A trainer worker's name (``WORKER.format(k)``): it serves several agents' trainers, swapping them."""


def assign_workers(agents: list[str], workers: int) -> dict[str, int]:
    """Which trainer worker serves each agent: agent i by worker i mod ``workers``. The one rule, for the specs
    below and the placement's requests and summary."""
    return {agent: index % workers for index, agent in enumerate(agents)}


def trainer_name(agent: str, rank: int = 0) -> str:
    """A trainer rank's name: ``<agent>/trainer``, and ``<agent>/trainer.<rank>`` for the other ranks of a trainer
    on several workers. The one place an actor's name is spelled, with :func:`engine_names` and
    :func:`process_name` (tests/test_architecture.py fails on a second)."""
    return f"{agent}/trainer" + (f".{rank}" if rank else "")


def engine_names(agent: str, replicas: int) -> list[str]:
    """The names of an agent's engine replicas: ``<agent>/engine`` alone, else ``<agent>/engine/<k>``."""
    return [f"{agent}/engine"] if replicas == 1 else [f"{agent}/engine/{k}" for k in range(replicas)]


def process_name(agent: str) -> str:
    """A hybrid agent's process (its engine replica 0 with its trainer inside)."""
    return f"{agent}/engine+trainer"


def bundle(cpus: float, gpus: float, resources: dict[str, float]) -> dict[str, float]:
    """A placement group bundle: what one actor in it reserves, zero amounts left out (Ray refuses them)."""
    return {name: amount for name, amount in {"CPU": cpus, "GPU": gpus, **resources}.items() if amount > 0}


@dataclass(frozen=True)
class GroupSpec:
    """A placement group: an agent's colocated engine and trainer, its trainer's ranks, or one engine replica split
    over several GPUs (a new group each time that replica starts)."""

    name: str
    kind: Literal["colocated", "trainer", "engine"]
    """Shared by a colocated agent's engine and trainer ranks (made once for the run), its trainer's ranks', or one
    engine replica's (made each time the replica starts)."""
    bundles: tuple[dict[str, float], ...]
    strategy: Literal["STRICT_PACK", "PACK"]


@dataclass(frozen=True)
class ActorSpec:
    """One actor, as it is started."""

    name: str
    """As in the plan's summary: ``<agent>/engine[/<k>]``, ``<agent>/trainer[.<rank>]``, ``trainer-worker-<k>``,
    ``<agent>/engine+trainer`` (a hybrid agent's process)."""
    role: Role
    agent: str | None
    """None for a trainer worker, which serves the agents of ``loads``."""
    index: int
    """The engine replica, the trainer rank or the worker's number."""
    cpus: float
    gpus: float
    """The actor's own ``num_gpus`` (0 for an engine whose vLLM workers take its group's GPUs)."""
    resources: dict[str, float] = field(default_factory=dict)
    """Custom Ray resources: the nodes it may run on."""
    threads: int = 1
    env: dict[str, str] = field(default_factory=dict)
    group: GroupSpec | None = None
    bundle: int | None = None
    """Its bundle in ``group``."""
    capture_children: bool = False
    """Whether the tasks and actors it starts (vLLM's Ray workers) are placed in its group."""
    loads: tuple[str, ...] = ()
    """The agents whose policy versions it loads from the store."""
    options: dict = field(default_factory=dict)
    """Its class's keyword arguments: the engine's, the trainer's, or for a trainer worker each agent's trainer's
    by agent (an agent process's are its ``parts``')."""
    keep: bool = False
    """Whether it may be kept idle for the next launch (cluster/warm_actors.py): one that holds no share of a group."""
    fitted: bool = False
    """Whether its CPU request was a default scaled down to fit the machine."""
    parts: tuple[ActorSpec, ...] = ()
    """An agent process's engine and trainer, as they would be started apart (its replica slot restarts as the
    engine alone)."""


def engine_options(agent: AgentSlice, threads: int) -> dict:
    """The keyword arguments of an agent's engine actors (``StoreAsyncEngine``) beside the store and version."""
    engine = agent.settings.engine
    return dict(gpu_memory_utilization=engine.gpu_memory_utilization, max_model_len=engine.max_model_len,
                dtype=engine.dtype, seed=agent.seed, threads=threads, kv_cache_gib=engine.kv_cache_gib,
                tensor_parallel_size=engine.tensor_parallel_size, sleep_mode=agent.settings.colocated)


def trainer_options(agent: AgentSlice, threads: int | None = None) -> dict:
    """``PolicyTrainer``'s keyword arguments for one agent, from its slice (the one place: the run's actors and a
    recomputed partition's in-process trainer alike). The KL penalty's reference and a LoRA agent's base are
    :data:`BASE_POLICY` when used. ``threads``: the actor's (None: ``trainer.threads``, else the process's own)."""
    trainer, algorithm, lora = agent.settings.trainer, agent.algorithm, agent.settings.lora
    return dict(lr=trainer.lr, weight_decay=trainer.weight_decay, max_grad_norm=trainer.max_grad_norm,
                clip_eps=algorithm.clip_eps, seed=agent.seed,
                num_threads=trainer.threads if threads is None else threads,
                lr_decay_steps=trainer.lr_decay_steps, min_lr_ratio=trainer.min_lr_ratio,
                kl_coef=algorithm.kl_coef, reference_dir=BASE_POLICY if algorithm.kl_coef > 0 else None,
                entropy_coef=algorithm.entropy_coef, loss_normalization=algorithm.loss_normalization,
                tis_cap=algorithm.tis_cap, dtype=trainer.dtype, chunk_tokens=trainer.chunk_tokens,
                lora=None if lora is None else lora.model_dump(), base_dir=None if lora is None else BASE_POLICY,
                activation_checkpointing=trainer.activation_checkpointing)


def split_engine_bundles(engine: EngineConfig, resources: dict[str, float]) -> tuple[dict[str, float], ...]:
    """The placement group of a replica split over ``tensor_parallel_size`` GPUs: one GPU per rank, the engine
    actor's CPUs (and custom resources) beside the first."""
    return (bundle(engine.num_cpus, 1.0, resources),) + (bundle(0, 1.0, {}),) * (engine.tensor_parallel_size - 1)


def colocation_group(agent: str, engine: EngineConfig, trainer: TrainerConfig, engine_resources: dict[str, float],
                     trainer_resources: dict[str, float]) -> GroupSpec:
    """A colocated agent's group: one GPU per trainer rank on one node, the engine actor's CPUs beside rank 0's."""
    first = {name: engine_resources.get(name, 0.0) + trainer_resources.get(name, 0.0)
             for name in {**engine_resources, **trainer_resources}}
    bundles = (bundle(engine.num_cpus + trainer.num_cpus, 1.0, first),)
    return GroupSpec(f"{agent}/colocated", "colocated", bundles + (bundle(trainer.num_cpus, 1.0, trainer_resources),)
                     * (trainer.workers - 1), "STRICT_PACK")


def thread_shares(synchronous: bool, cpus: dict[str, float], kinds: dict[str, str], cluster_cpus: float,
                  node_cpus: float) -> dict[str, int]:
    """Each reservation's threads (``cpus``: by plan name, ``kinds``: ``engine`` or ``trainer``): its share of the
    cluster's CPUs among the reservations that compute at the same time, by :func:`shared_threads`. Streaming:
    every engine and trainer (an agent's engine samples micro-batch k+1 while its trainer trains on k).
    ``synchronous``: those of its own kind only, as the step's rollout and its training take turns, so an agent
    alone gets all of a node's cores for each (OpenMP threads beyond the cores of the actors running at once slow
    them all down)."""
    def peers(name: str) -> list[float]:
        if not synchronous:
            return list(cpus.values())
        return [amount for other, amount in cpus.items() if kinds[other] == kinds[name]]

    return {name: shared_threads(amount, peers(name), cluster_cpus, node_cpus) for name, amount in cpus.items()}


def shared_threads(num_cpus: float, reserved: list[float], cluster_cpus: float, node_cpus: float) -> int:
    """Threads for an actor reserving ``num_cpus`` among actors computing at the same time that reserve ``reserved``
    (it included): its share of the cluster's CPUs in proportion to its reservation (equal shares when nothing is
    reserved), rounded down, at least 1 and at most one node's CPUs. Not Ray's rule, which gives an actor with
    fractional ``num_cpus`` one OpenMP thread (a 0.5-CPU trainer on an idle 2-core machine computed on one core)."""
    total = sum(reserved)
    share = num_cpus / total if total > 0 else 1 / max(len(reserved), 1)
    return int(max(1, min(node_cpus, cluster_cpus * share)))


@dataclass(frozen=True)
class EngineSet:
    """How an agent's engine replicas are routed (inference/replicas.py): what the plan gives its router."""

    agent: str
    max_outstanding: int | None
    capacity: int | None
    """Replica slots (None: its replicas); with rebalancing, every replica of the run but one per other agent."""


def engine_sets(agents: dict[str, AgentConfig], rebalance: bool) -> dict[str, EngineSet]:
    """Each agent's :class:`EngineSet` (``rebalance``: ``pipeline.rollout.rebalance_replicas``)."""
    budget = sum(agent.engine.replicas for agent in agents.values())
    capacity = budget - len(agents) + 1 if rebalance else None
    return {agent: EngineSet(agent, agent_config.engine.max_outstanding, capacity)
            for agent, agent_config in agents.items()}


def actor_specs(agents: list[AgentSlice], ray: RayConfig, synchronous: bool,
                reserved: dict[str, tuple[float, float, bool]], workers: int, cluster_cpus: float,
                node_cpus: float) -> list[ActorSpec]:
    """The run's actors, from the agents' slices, the Ray settings (custom resources) and the pipeline's mode, and
    from what the plan reserves for each name (CPUs, GPUs, fitted): each agent's engine replicas and trainer ranks,
    or the trainer workers that swap them (``workers`` of them, 0 for none)."""
    kinds = {name: "engine" if "/engine" in name else "trainer" for name in reserved}
    shares = thread_shares(synchronous, {name: cpus for name, (cpus, _, _) in reserved.items()}, kinds,
                           cluster_cpus, node_cpus)
    custom = {"engine": dict(ray.engine_resources), "trainer": dict(ray.trainer_resources)}
    slices = {one.name: one for one in agents}
    specs = []
    for agent, one in slices.items():
        agent_config = one.settings
        engine, trainer = agent_config.engine, agent_config.trainer
        names = engine_names(agent, engine.replicas)
        engine_threads = engine.threads or shares[names[0]]
        options = engine_options(one, engine_threads)
        split = engine.tensor_parallel_size > 1
        colocated = agent_config.colocated and engine.num_gpus > 0
        group = colocation_group(agent, engine, trainer, custom["engine"], custom["trainer"]) if colocated else None
        for k, name in enumerate(names):
            cpus, gpus, fitted = reserved[name]
            common = dict(name=name, role="engine", agent=agent, index=k, cpus=cpus, resources=custom["engine"],
                          threads=engine_threads, loads=(agent,), options=options, fitted=fitted)
            if colocated:  # half of bundle 0's GPU, or its vLLM workers half of each bundle's; resources in the group
                env = dict(ENGINE_ENV)
                if split:
                    env |= {"VLLM_RAY_PER_WORKER_GPUS": str(SHARE),
                            "VLLM_RAY_BUNDLE_INDICES": ",".join(str(r) for r in range(engine.tensor_parallel_size))}
                specs.append(ActorSpec(**{**common, "resources": {}}, gpus=0 if split else SHARE, env=env, group=group,
                                       bundle=0, capture_children=split))
            elif split:  # its vLLM workers take the group's GPUs, as children of the actor placed in it
                own = GroupSpec(name, "engine", split_engine_bundles(engine, custom["engine"]), "STRICT_PACK")
                specs.append(ActorSpec(**common, gpus=0, env=dict(ENGINE_ENV), group=own, bundle=0,
                                       capture_children=True))
            elif agent_config.hybrid and k == 0:  # replica 0 and the trainer in one process, reserving the two
                trainer_cpus, trainer_gpus, _ = reserved[trainer_name(agent)]
                threads = trainer.threads or shares[trainer_name(agent)]
                parts = (ActorSpec(**common, gpus=gpus, env=dict(ENGINE_ENV), keep=True),
                         ActorSpec(trainer_name(agent), "trainer", agent, 0, trainer_cpus, trainer_gpus,
                                   custom["trainer"], threads, loads=(agent,),
                                   options=trainer_options(one, threads)))
                both = {r: custom["engine"].get(r, 0.0) + custom["trainer"].get(r, 0.0)
                        for r in {*custom["engine"], *custom["trainer"]}}
                specs.append(ActorSpec(process_name(agent), "agent-process", agent, 0, cpus + trainer_cpus,
                                       gpus, both, engine_threads, dict(ENGINE_ENV), loads=(agent,), parts=parts,
                                       fitted=fitted))
            else:
                specs.append(ActorSpec(**common, gpus=gpus, env=dict(ENGINE_ENV), keep=True))
        if workers or agent_config.hybrid:
            continue
        ranks = [trainer_name(agent, rank) for rank in range(trainer.workers)]
        threads = trainer.threads or shares[ranks[0]]
        if trainer.workers > 1 and not colocated:
            group = GroupSpec(trainer_name(agent), "trainer", (bundle(*reserved[ranks[0]][:2], custom["trainer"]),)
                              * trainer.workers, "PACK")
        for rank, name in enumerate(ranks):
            cpus, gpus, fitted = reserved[name]
            specs.append(ActorSpec(name, "trainer", agent, rank, cpus, SHARE if colocated else gpus,
                                   {} if colocated else custom["trainer"], threads, group=group,
                                   bundle=None if group is None else rank,
                                   loads=(agent,), options=trainer_options(one, threads),
                                   keep=group is None, fitted=fitted))
    explicit = [one.settings.trainer.threads for one in agents if one.settings.trainer.threads is not None]
    served = assign_workers(list(slices), workers) if workers else {}
    for k in range(workers):  # each serves agents k, k + workers, ...: the largest request, the most threads asked
        name = WORKER.format(k)
        cpus, gpus, fitted = reserved[name]
        threads = max(explicit) if explicit else shares[name]
        served_agents = tuple(agent for agent, worker in served.items() if worker == k)
        specs.append(ActorSpec(name, "trainer-worker", None, k, cpus, gpus, custom["trainer"], threads,
                               loads=served_agents,
                               options={agent: trainer_options(slices[agent], threads) for agent in served_agents},
                               fitted=fitted))
    return specs
