"""Placement: which Ray resources each agent's engine and trainer get, checked against the cluster before anything
starts.

Without it, a run that asks for more than the cluster has does not fail: Ray queues the actors that do not fit
and the launch waits (an environment with three agents, written from the docs alone, hung at start on a 2-core
machine: 3 x (engine 0.5 + trainer 0.5 CPU) is more than 2 CPUs). So:

- requests the config sets explicitly are kept, and a plan they cannot satisfy fails at once with the
  arithmetic ("3 agents need 3.0 CPUs ...; the cluster has 2");
- requests left at their defaults are fitted to the machine: scaled down together so that every actor fits
  (Ray accepts fractional CPUs; an actor's real CPU use is bounded by its threads, not by the reservation).

Each actor must also fit on one node, not only in the cluster's total: checked by first-fit decreasing over the
nodes' resources, the way Ray's scheduler would have to place them. Custom resources (``ray.engine_resources``,
``ray.trainer_resources``) pin engines and trainers to the nodes that offer them; they are checked the same way,
and a resource no node offers is named at once (Ray would queue the actor for ever). All trainers stay resident
(swapping them out between steps is not implemented), which the plan says.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from marl_pipeline.config import ExperimentConfig

RESOURCES = ("CPU", "GPU")
DECIMALS = 4
"""Ray rounds fractional resources to 4 decimals; a fitted request is rounded down to stay within the total."""


class PlacementError(RuntimeError):
    """The run's actors cannot be placed on the cluster; the message has the arithmetic."""


@dataclass(frozen=True)
class ActorRequest:
    """One actor's resources: ``<agent>/engine`` or ``<agent>/trainer``."""

    name: str
    cpus: float
    gpus: float
    fitted: bool = False
    """Whether the CPU request was a default scaled down to fit the machine."""
    resources: dict[str, float] = field(default_factory=dict)
    """Custom Ray resources (``ray.engine_resources`` / ``trainer_resources``): the nodes it may run on."""


@dataclass(frozen=True)
class PlacementPlan:
    """What each actor reserves, and where the plan came from; shown in the run's metadata."""

    actors: list[ActorRequest]
    cluster: dict[str, float]
    resident_trainers: list[str] = field(default_factory=list)
    swapped_trainers: list[str] = field(default_factory=list)

    def request(self, name: str) -> ActorRequest:
        return next(actor for actor in self.actors if actor.name == name)

    def fitted(self, config: ExperimentConfig) -> ExperimentConfig:
        """``config`` with each engine's and trainer's ``num_cpus`` as planned (the fitted defaults filled in)."""
        agents = {}
        for agent, agent_config in config.agents.items():
            engine = agent_config.engine.model_copy(update={"num_cpus": self.request(f"{agent}/engine").cpus})
            trainer = agent_config.trainer.model_copy(update={"num_cpus": self.request(f"{agent}/trainer").cpus})
            agents[agent] = agent_config.model_copy(update={"engine": engine, "trainer": trainer})
        return config.model_copy(update={"agents": agents})

    def summary(self) -> dict[str, str]:
        """One line per actor and the totals, for Dagster metadata and the CLI."""
        lines = {actor.name: f"{actor.cpus:g} CPU, {actor.gpus:g} GPU" + (" (fitted)" if actor.fitted else "")
                 + "".join(f", {amount:g} {name}" for name, amount in sorted(actor.resources.items()))
                 for actor in self.actors}
        used = {r: sum(getattr(a, f"{r.lower()}s") for a in self.actors) for r in RESOURCES}
        lines["total"] = ", ".join(f"{used[r]:g} of {self.cluster.get(r, 0):g} {r}" for r in RESOURCES)
        lines["trainers"] = f"resident: {', '.join(self.resident_trainers)}; swapped: none"
        return lines


def plan_placement(config: ExperimentConfig, nodes: list[dict[str, float]]) -> PlacementPlan:
    """The run's actor requests, fitted and checked against ``nodes`` (each a node's total resources, as
    ``ray.nodes()[i]["Resources"]``).

    Raises:
        PlacementError: the explicit requests do not fit, naming the totals and what each agent asks for.
    """
    cluster = {r: sum(node.get(r, 0.0) for node in nodes) for r in RESOURCES}
    explicit, defaults = [], []
    custom = {"engine": dict(config.ray.engine_resources), "trainer": dict(config.ray.trainer_resources)}
    for agent, agent_config in config.agents.items():
        for role, settings in (("engine", agent_config.engine), ("trainer", agent_config.trainer)):
            request = ActorRequest(f"{agent}/{role}", settings.num_cpus, settings.num_gpus, resources=custom[role])
            (explicit if "num_cpus" in settings.model_fields_set else defaults).append(request)
    fixed_cpus = sum(actor.cpus for actor in explicit)
    default_cpus = sum(actor.cpus for actor in defaults)
    spare = cluster["CPU"] - fixed_cpus
    if defaults and default_cpus > spare > 0:
        scale = spare / default_cpus
        defaults = [ActorRequest(a.name, _round_down(a.cpus * scale), a.gpus, fitted=True, resources=a.resources)
                    for a in defaults]
    actors = sorted(explicit + defaults, key=lambda a: list(config.agents).index(a.name.split("/")[0]))
    _check_totals(config, actors, cluster)
    _check_custom(actors, nodes)
    _check_nodes(actors, nodes)
    trainers = [a.name for a in actors if a.name.endswith("/trainer")]
    return PlacementPlan(actors, cluster, resident_trainers=trainers)


def _round_down(value: float) -> float:
    scale = 10**DECIMALS
    return int(value * scale) / scale


def _check_totals(config: ExperimentConfig, actors: list[ActorRequest], cluster: dict[str, float]) -> None:
    for resource in RESOURCES:
        asked = sum(getattr(a, f"{resource.lower()}s") for a in actors)
        if asked > cluster[resource] + 1e-9:
            per_agent = "; ".join(
                f"{agent}: engine {_amount(actors, f'{agent}/engine', resource):g} + trainer "
                f"{_amount(actors, f'{agent}/trainer', resource):g}" for agent in config.agents)
            raise PlacementError(
                f"{len(config.agents)} agents need {asked:g} {resource}s ({per_agent}); the cluster has "
                f"{cluster[resource]:g}. Lower agents.<name>.engine/trainer.num_{resource.lower()}s, or leave them "
                f"unset to share the machine, or give Ray more.")


def _amount(actors: list[ActorRequest], name: str, resource: str) -> float:
    return getattr(next(a for a in actors if a.name == name), f"{resource.lower()}s")


def _check_custom(actors: list[ActorRequest], nodes: list[dict[str, float]]) -> None:
    """Every custom resource asked for is offered by some node, and in the amount all actors together ask."""
    asked: dict[str, float] = {}
    for actor in actors:
        for name, amount in actor.resources.items():
            asked[name] = asked.get(name, 0.0) + amount
    for name, amount in sorted(asked.items()):
        role = "engine" if any(name in a.resources for a in actors if a.name.endswith("/engine")) else "trainer"
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


def _check_nodes(actors: list[ActorRequest], nodes: list[dict[str, float]]) -> None:
    """First-fit decreasing: every actor on a node with room for it (CPUs, GPUs and its custom resources)."""
    free = [dict(node) for node in nodes]
    for actor in sorted(actors, key=lambda a: (a.gpus, a.cpus), reverse=True):
        wanted = {"CPU": actor.cpus, "GPU": actor.gpus, **actor.resources}
        for node in free:
            if all(node.get(name, 0.0) + 1e-9 >= amount for name, amount in wanted.items() if amount > 0):
                for name, amount in wanted.items():
                    node[name] = node.get(name, 0.0) - amount
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
