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
nodes' resources, the way Ray's scheduler would have to place them. All trainers stay resident (swapping them
out between steps is not implemented), which the plan says.
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
    for agent, agent_config in config.agents.items():
        for role, settings in (("engine", agent_config.engine), ("trainer", agent_config.trainer)):
            request = ActorRequest(f"{agent}/{role}", settings.num_cpus, settings.num_gpus)
            (explicit if "num_cpus" in settings.model_fields_set else defaults).append(request)
    fixed_cpus = sum(actor.cpus for actor in explicit)
    default_cpus = sum(actor.cpus for actor in defaults)
    spare = cluster["CPU"] - fixed_cpus
    if defaults and default_cpus > spare > 0:
        scale = spare / default_cpus
        defaults = [ActorRequest(a.name, _round_down(a.cpus * scale), a.gpus, fitted=True) for a in defaults]
    actors = sorted(explicit + defaults, key=lambda a: list(config.agents).index(a.name.split("/")[0]))
    _check_totals(config, actors, cluster)
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


def _check_nodes(actors: list[ActorRequest], nodes: list[dict[str, float]]) -> None:
    """First-fit decreasing: every actor on a node with room for it."""
    free = [{r: node.get(r, 0.0) for r in RESOURCES} for node in nodes]
    for actor in sorted(actors, key=lambda a: (a.gpus, a.cpus), reverse=True):
        for node in free:
            if node["CPU"] + 1e-9 >= actor.cpus and node["GPU"] + 1e-9 >= actor.gpus:
                node["CPU"] -= actor.cpus
                node["GPU"] -= actor.gpus
                break
        else:
            largest = max(free, key=lambda n: (n["GPU"], n["CPU"]), default={"CPU": 0.0, "GPU": 0.0})
            raise PlacementError(
                f"{actor.name} needs {actor.cpus:g} CPU and {actor.gpus:g} GPU on one node; after the larger actors "
                f"the roomiest node has {largest['CPU']:g} CPU and {largest['GPU']:g} GPU free ({len(nodes)} nodes)")
