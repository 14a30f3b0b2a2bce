"""Placement: which Ray resources each agent's engine and trainer get, and which trainers stay resident or are
swapped, checked against the cluster before anything starts.

Without it, a run that asks for more than the cluster has does not fail: Ray queues the actors that do not fit
and the launch waits for ever (three agents whose engines and trainers ask for 0.5 CPU each need 3 CPUs, more than
a 2-core machine has). So:

- requests the config sets explicitly are kept, and a plan they cannot satisfy fails at once with the
  arithmetic ("3 agents need 3.0 CPUs ...; the cluster has 2");
- requests left at their defaults are fitted to the machine: scaled down together so that every actor fits
  (Ray accepts fractional CPUs; an actor's real CPU use is bounded by its threads, not by the reservation);
- trainers: ``ray.resident_trainers`` (the trainer budget) N below the number of agents gives N trainer worker
  actors serving every agent by swapping (``training/swap.py``), each reserving the largest agent's trainer
  request. Left unset, every trainer is resident when that fits, else the most workers that fit.

Each actor must also fit on one node, not only in the cluster's total: checked by first-fit decreasing over the
nodes' resources, the way Ray's scheduler would have to place them. Custom resources (``ray.engine_resources``,
``ray.trainer_resources``) pin engines and trainers (trainer workers too) to the nodes that offer them; they are
checked the same way, and a resource no node offers is named at once (Ray would queue the actor for ever).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from marl_pipeline.cluster.specs import (
    WORKER,
    ActorSpec,
    EngineSet,
    actor_specs,
    assign_workers,
    engine_names,
    engine_sets,
    process_name,
    trainer_name,
)
from marl_pipeline.config import ExperimentConfig

RESOURCES = ("CPU", "GPU")
DECIMALS = 4
"""Ray rounds fractional resources to 4 decimals; a fitted request is rounded down to stay within the total."""


class PlacementError(RuntimeError):
    """The run's actors cannot be placed on the cluster; the message has the arithmetic."""


@dataclass(frozen=True)
class ActorRequest:
    """One actor's resources: ``<agent>/engine`` (``<agent>/engine/<k>`` for each of several replicas),
    ``<agent>/trainer`` or ``trainer-worker-<k>``."""

    name: str
    cpus: float
    gpus: float
    fitted: bool = False
    """Whether the CPU request was a default scaled down to fit the machine."""
    resources: dict[str, float] = field(default_factory=dict)
    """Custom Ray resources (``ray.engine_resources`` / ``trainer_resources``): the nodes it may run on."""
    colocated: str | None = None
    """The agent whose engine and trainer share GPUs (``agents.<a>.colocated`` with GPUs), this actor being one of
    them: each reserves half of every GPU it uses, and they are placed on one node together (cluster/colocation.py)."""
    process: str | None = None
    """The hybrid agent (``agents.<a>.hybrid``) whose engine replica 0 and trainer this is: one actor on one node,
    reserving the two requests (cluster/hybrid.py)."""


def swapping(config: ExperimentConfig) -> bool:
    """Whether the trainer budget (``ray.resident_trainers``) is below the number of agents."""
    budget = config.ray.resident_trainers
    return budget is not None and budget < len(config.agents)


@dataclass(frozen=True)
class PlacementPlan:
    """What each actor reserves, which trainers are resident or swapped, and where the plan came from; shown in
    the run's metadata."""

    actors: list[ActorRequest]
    cluster: dict[str, float]
    resident_trainers: list[str] = field(default_factory=list)
    swapped_trainers: list[str] = field(default_factory=list)
    trainer_workers: int = 0
    """Worker actors serving the swapped trainers (0: every trainer resident)."""
    specs: list[ActorSpec] = field(default_factory=list)
    """One per actor to start (a hybrid agent's two requests are one process): what spawn.py starts."""
    engine_sets: dict[str, EngineSet] = field(default_factory=dict)
    """How each agent's engine replicas are routed."""
    node_of: dict[str, int] = field(default_factory=dict)
    """Each actor's node, as the plan checked they fit (an index in the nodes it was made on)."""
    run: str = ""
    handovers: tuple[str, ...] = ()
    """Agents whose engine and trainer take turns on their devices (``agents.<a>.colocated``): the engine sleeps
    while the trainer trains (cluster/colocation.py), whether or not they share GPUs (``ActorRequest.colocated``)."""
    movable_trainers: tuple[str, ...] = ()
    """Trainer actors whose threads the core split may move between steps (cluster/cores.py): in streaming mode,
    resident, on one worker without a GPU, their threads not set in the config."""

    def agent_specs(self, agent: str, role: str) -> list[ActorSpec]:
        """An agent's specs of one role (``engine``, ``trainer``; its process counts as both when hybrid)."""
        return [spec for spec in self.specs if spec.agent == agent and spec.role in (role, "agent-process")]

    def request(self, name: str) -> ActorRequest:
        return next(actor for actor in self.actors if actor.name == name)

    def trainer_request(self, agent: str) -> ActorRequest:
        """What ``agent``'s trainer runs in: its own actor, or the worker that serves it."""
        if trainer_name(agent) in self.resident_trainers:
            return self.request(trainer_name(agent))
        agents = [name.split("/")[0] for name in self.swapped_trainers]
        return self.request(WORKER.format(assign_workers(agents, self.trainer_workers)[agent]))

    def summary(self) -> dict[str, str]:
        """One line per actor and the totals, for Dagster metadata and the CLI."""
        lines = {actor.name: f"{actor.cpus:g} CPU, {actor.gpus:g} GPU" + (" (fitted)" if actor.fitted else "")
                 + "".join(f", {amount:g} {name}" for name, amount in sorted(actor.resources.items()))
                 + (f", GPUs shared by {actor.colocated}'s engine and trainer" if actor.colocated else "")
                 + (f", in one process with {actor.process}'s " + ("trainer" if "/engine" in actor.name else "engine")
                    if actor.process else "")
                 for actor in self.actors}
        used = {r: sum(getattr(a, f"{r.lower()}s") for a in self.actors) for r in RESOURCES}
        lines["total"] = ", ".join(f"{used[r]:g} of {self.cluster.get(r, 0):g} {r}" for r in RESOURCES)
        swapped = "none"
        if self.swapped_trainers:
            agents = [name.split("/")[0] for name in self.swapped_trainers]
            served = assign_workers(agents, self.trainer_workers)
            swapped = f"{', '.join(self.swapped_trainers)} on {self.trainer_workers} trainer workers (" + "; ".join(
                f"{WORKER.format(k)}: {', '.join(a for a in agents if served[a] == k)}"
                for k in range(self.trainer_workers)) + "), state in the Ray object store between calls"
        lines["trainers"] = f"resident: {', '.join(self.resident_trainers) or 'none'}; swapped: {swapped}"
        return lines


def plan_placement(config: ExperimentConfig, nodes: list[dict[str, float]]) -> PlacementPlan:
    """The run's actor requests, fitted and checked against ``nodes`` (each a node's total resources, as
    ``ray.nodes()[i]["Resources"]``).

    Raises:
        PlacementError: the explicit requests do not fit, naming the totals and what each agent asks for.
    """
    agents = len(config.agents)
    budget = config.ray.resident_trainers
    sharded = [agent for agent, agent_config in config.agents.items() if agent_config.trainer.workers > 1]
    if sharded and budget is not None and budget < agents:
        raise PlacementError(f"agents {sharded} train on several workers (trainer.workers), which swapping cannot "
                             f"move: set ray.resident_trainers to {agents} (or leave it unset), or their "
                             f"trainer.workers to 1")
    if budget is not None:
        return _plan(config, nodes, min(budget, agents))
    try:
        return _plan(config, nodes, agents)
    except PlacementError as resident:
        if hybrid := [agent for agent, agent_config in config.agents.items() if agent_config.hybrid]:
            raise PlacementError(f"{resident} Swapping the trainers cannot help: agents {hybrid} are hybrid (their "
                                 f"trainers live in their engines' processes).") from None
        if sharded:
            raise PlacementError(f"{resident} Swapping the trainers cannot help: agents {sharded} train on several "
                                 f"workers (trainer.workers).") from None
        for workers in range(agents - 1, 0, -1):  # the most trainer workers that fit: the least swapping
            try:
                return _plan(config, nodes, workers)
            except PlacementError:
                continue
        raise PlacementError(f"{resident} Swapping the trainers does not fit either: not even one trainer worker "
                             f"serving every agent (ray.resident_trainers: 1).") from None


def _plan(config: ExperimentConfig, nodes: list[dict[str, float]], workers: int) -> PlacementPlan:
    """The plan with ``workers`` trainer actors (one per agent: every trainer resident)."""
    cluster = {r: sum(node.get(r, 0.0) for node in nodes) for r in RESOURCES}
    resident = workers >= len(config.agents)
    custom = {"engine": dict(config.ray.engine_resources), "trainer": dict(config.ray.trainer_resources)}
    requests = []  # (request, explicit)
    for agent, agent_config in config.agents.items():
        engine = agent_config.engine
        parts = [(name, "engine", engine) for name in engine_names(agent, engine.replicas)]
        if resident:  # one actor per worker: rank 0 is the agent's trainer, the others its ranks
            ranks = range(agent_config.trainer.workers)
            parts += [(trainer_name(agent, rank), "trainer", agent_config.trainer) for rank in ranks]
        shares = agent_config.colocated and engine.num_gpus > 0  # an engine and a trainer rank on each GPU
        process = agent if agent_config.hybrid else None
        for name, role, settings in parts:
            requests.append((ActorRequest(name, settings.num_cpus, settings.num_gpus * (0.5 if shares else 1.0),
                                          resources=custom[role], colocated=agent if shares else None,
                                          process=process if name in (parts[0][0], trainer_name(agent)) else None),
                             "num_cpus" in settings.model_fields_set))
    if not resident:  # a worker may serve any agent: it reserves the largest trainer request
        trainers = [agent_config.trainer for agent_config in config.agents.values()]
        explicit = any("num_cpus" in trainer.model_fields_set for trainer in trainers)
        cpus, gpus = max(t.num_cpus for t in trainers), max(t.num_gpus for t in trainers)
        requests += [(ActorRequest(WORKER.format(k), cpus, gpus, resources=custom["trainer"]), explicit)
                     for k in range(workers)]
    fixed_cpus = sum(request.cpus for request, explicit in requests if explicit)
    default_cpus = sum(request.cpus for request, explicit in requests if not explicit)
    spare = cluster["CPU"] - fixed_cpus
    if default_cpus > spare > 0:
        scale = spare / default_cpus
        requests = [(r if explicit else replace(r, cpus=_round_down(r.cpus * scale), fitted=True), explicit)
                    for r, explicit in requests]
    actors = [request for request, _ in requests]
    _check_totals(config, actors, cluster, workers)
    _check_custom(actors, nodes)
    node_of = _check_nodes(actors, nodes)
    trainers = [trainer_name(agent) for agent in config.agents]
    node_cpus = max((node.get("CPU", 0.0) for node in nodes), default=1.0)
    slices = [config.agent_slice(agent) for agent in config.agents]
    specs = actor_specs(slices, config.ray, config.pipeline.mode == "synchronous",
                        {a.name: (a.cpus, a.gpus, a.fitted) for a in actors}, 0 if resident else workers,
                        cluster["CPU"] or 1.0, node_cpus or 1.0)
    handovers = tuple(agent for agent, agent_config in config.agents.items() if agent_config.colocated)
    movable = tuple(trainer_name(agent) for agent, agent_config in config.agents.items()
                    if resident and config.pipeline.mode == "streaming" and agent_config.trainer.threads is None
                    and agent_config.trainer.num_gpus == 0 and agent_config.trainer.workers == 1)
    layout = dict(specs=specs, engine_sets=engine_sets(config.agents, config.pipeline.rollout.rebalance_replicas),
                  run=config.run, node_of=node_of,
                  handovers=handovers, movable_trainers=movable)
    if resident:
        return PlacementPlan(actors, cluster, resident_trainers=trainers, **layout)
    return PlacementPlan(actors, cluster, swapped_trainers=trainers, trainer_workers=workers, **layout)


def _round_down(value: float) -> float:
    scale = 10**DECIMALS
    return int(value * scale) / scale


def _check_totals(config: ExperimentConfig, actors: list[ActorRequest], cluster: dict[str, float],
                  workers: int) -> None:
    for resource in RESOURCES:
        asked = sum(getattr(a, f"{resource.lower()}s") for a in actors)
        if asked > cluster[resource] + 1e-9:
            if workers >= len(config.agents):
                per_agent = "; ".join(
                    f"{agent}: engine {_engines(config, actors, agent, resource)} + trainer "
                    f"{_trainers(config, actors, agent, resource)}" for agent in config.agents)
                needs = f"{len(config.agents)} agents need"
            else:
                per_agent = "; ".join(f"{agent}: engine {_engines(config, actors, agent, resource)}"
                                      for agent in config.agents)
                per_agent += f"; {workers} trainer workers x {_amount(actors, WORKER.format(0), resource):g}"
                needs = f"{len(config.agents)} agents with {workers} swapping trainer workers need"
            raise PlacementError(
                f"{needs} {asked:g} {resource}s ({per_agent}); the cluster has "
                f"{cluster[resource]:g}. Lower agents.<name>.engine/trainer.num_{resource.lower()}s, or leave them "
                f"unset to share the machine, or give Ray more.")


def _engines(config: ExperimentConfig, actors: list[ActorRequest], agent: str, resource: str) -> str:
    """An agent's engine request in an error: ``0.5``, or ``2 replicas x 0.5``."""
    names = engine_names(agent, config.agents[agent].engine.replicas)
    amount = f"{_amount(actors, names[0], resource):g}"
    return amount if len(names) == 1 else f"{len(names)} replicas x {amount}"


def _trainers(config: ExperimentConfig, actors: list[ActorRequest], agent: str, resource: str) -> str:
    """An agent's resident trainer request in an error: ``0.5``, or ``2 workers x 0.5``."""
    workers, amount = config.agents[agent].trainer.workers, f"{_amount(actors, trainer_name(agent), resource):g}"
    return amount if workers == 1 else f"{workers} workers x {amount}"


def _amount(actors: list[ActorRequest], name: str, resource: str) -> float:
    return getattr(next(a for a in actors if a.name == name), f"{resource.lower()}s")


def _check_custom(actors: list[ActorRequest], nodes: list[dict[str, float]]) -> None:
    """Every custom resource asked for is offered by some node, and in the amount all actors together ask."""
    asked: dict[str, float] = {}
    for actor in actors:
        for name, amount in actor.resources.items():
            asked[name] = asked.get(name, 0.0) + amount
    for name, amount in sorted(asked.items()):
        role = "engine" if any(name in a.resources for a in actors if "/engine" in a.name) else "trainer"
        offered = sum(node.get(name, 0.0) for node in nodes)
        users = ", ".join(a.name for a in actors if name in a.resources)
        if offered == 0:
            raise PlacementError(
                f"ray.{role}_resources asks for custom resource {name!r} ({users}), but no alive Ray node offers it "
                f"({len(nodes)} nodes, offering {_custom_names(nodes) or 'no custom resources'}). Start a node with "
                f"`ray start --resources '{{\"{name}\": N}}'`, or remove it from ray.{role}_resources.")
        if amount > offered + 1e-9:
            raise PlacementError(f"{users} ask for {amount:g} {name!r} in all; the cluster's nodes offer {offered:g}. "
                                 f"Lower ray.{role}_resources.{name} or start nodes with more.")


def _custom_names(nodes: list[dict[str, float]]) -> str:
    names = sorted({name for node in nodes for name in node
                    if name not in (*RESOURCES, "memory", "object_store_memory") and not name.startswith("node:")})
    return ", ".join(names)


def _check_nodes(actors: list[ActorRequest], nodes: list[dict[str, float]]) -> dict[str, int]:
    """First-fit decreasing: every actor on a node with room for it (CPUs, GPUs and its custom resources); an agent's
    colocated engine and trainer ranks as one, as their placement group packs them on one node. -> each actor's
    node (its index in ``nodes``)."""
    def together(actor: ActorRequest) -> str | None:
        return actor.colocated or actor.process

    units = [actor for actor in actors if together(actor) is None]
    members = {actor.name: [actor] for actor in units}  # the actors each unit places
    for agent in dict.fromkeys(together(actor) for actor in actors if together(actor) is not None):
        shared = [actor for actor in actors if together(actor) == agent]
        units.append(ActorRequest(process_name(agent), sum(a.cpus for a in shared), sum(a.gpus for a in shared),
                                  resources={name: sum(a.resources.get(name, 0.0) for a in shared)
                                             for a in shared for name in a.resources}))
        members[units[-1].name] = shared
    free = [dict(node) for node in nodes]
    placed = {}
    for actor in sorted(units, key=lambda a: (a.gpus, a.cpus), reverse=True):
        wanted = {"CPU": actor.cpus, "GPU": actor.gpus, **actor.resources}
        for index, node in enumerate(free):
            if all(node.get(name, 0.0) + 1e-9 >= amount for name, amount in wanted.items() if amount > 0):
                for name, amount in wanted.items():
                    node[name] = node.get(name, 0.0) - amount
                placed |= {member.name: index for member in members[actor.name]}
                break
        else:
            candidates = [n for n in free if all(n.get(r, 0.0) > 0 for r in actor.resources)]
            largest = max(candidates, key=lambda n: (n.get("GPU", 0.0), n.get("CPU", 0.0)),
                          default={"CPU": 0.0, "GPU": 0.0})
            pinned = f" among the {len(candidates)} nodes with {sorted(actor.resources)}" if actor.resources else ""
            raise PlacementError(
                f"{actor.name} needs {actor.cpus:g} CPU and {actor.gpus:g} GPU on one node; after the larger actors "
                f"the roomiest node{pinned} has {largest.get('CPU', 0.0):g} CPU and {largest.get('GPU', 0.0):g} GPU "
                f"free ({len(nodes)} nodes)")
    return placed
