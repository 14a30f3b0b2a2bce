"""The planner's entry points: costs from a stored run, a prediction for an experiment on a described cluster.

The calibration run is planned again as it ran (its recorded config on the same nodes), so each agent's threads
and replicas, which turn its stored seconds into costs, are the ones its actors had.
"""

from __future__ import annotations

import re

from marl_pipeline.cluster.placement import PlacementPlan, plan_placement
from marl_pipeline.config import ExperimentConfig, parse_config
from marl_pipeline.planner.costs import Costs, Layout, calibrate
from marl_pipeline.planner.simulate import Prediction, simulate
from marl_pipeline.run.launches import launch_history
from marl_pipeline.store import ExperienceStore

CLUSTER = re.compile(r"^(?:(\d+)x)?(\d+(?:\.\d+)?)(?::(\d+))?$")


def parse_cluster(text: str) -> list[dict[str, float]]:
    """``NODESxCPUS[:GPUS]`` (``48x96:8``: 48 nodes of 96 CPUs and 8 GPUs; ``2``: one node of 2 CPUs).

    Raises:
        ValueError: the text is not of that form.
    """
    match = CLUSTER.match(text.strip())
    if match is None:
        raise ValueError(f"--cluster {text!r}: expected NODESxCPUS[:GPUS], e.g. 2 (one node of 2 CPUs) or 48x96:8")
    nodes, cpus, gpus = int(match[1] or 1), float(match[2]), float(match[3] or 0)
    return [{"CPU": cpus, "GPU": gpus} for _ in range(nodes)]


def layouts(plan: PlacementPlan) -> dict[str, Layout]:
    """Each agent's engine and trainer threads and engine replicas, as the plan's specs give them."""
    result = {}
    for agent in plan.engine_sets:
        engines = plan.agent_specs(agent, "engine")
        first = engines[0].parts[0] if engines[0].parts else engines[0]
        trainer = next((spec.parts[1] if spec.parts else spec for spec in plan.agent_specs(agent, "trainer")), None)
        if trainer is None:  # swapped: the worker that serves it
            trainer = next(spec for spec in plan.specs if spec.role == "trainer-worker" and agent in spec.loads)
        result[agent] = Layout(first.threads, trainer.threads, len(engines))
    return result


def calibration(store: ExperienceStore, run: str, nodes: list[dict[str, float]]) -> Costs:
    """The costs of run ``run``'s newest launch, planned on ``nodes`` as it ran.

    Raises:
        ValueError: the run has no recorded launch, or nothing committed to fit from.
    """
    launches, configs = launch_history(store, run)
    if not launches:
        raise ValueError(f"run {run!r} has no recorded launch in {store.config.uri}")
    config = parse_config(configs[launches[-1]["config"]])
    return calibrate(store, run, layouts(plan_placement(config, nodes)))


def predict(config: ExperimentConfig, nodes: list[dict[str, float]], costs: Costs,
            steps: int | None = None) -> tuple[PlacementPlan, Prediction]:
    """The experiment's placement plan on ``nodes`` and its simulated steps.

    Raises:
        PlacementError: the plan does not fit (with the arithmetic).
        ValueError: the costs have no figures for some of the experiment's agents.
    """
    if missing := sorted(set(config.agents) - set(costs.engines)):
        raise ValueError(f"the costs ({costs.source}) have no figures for agents {missing}: calibrate from a run "
                         f"with the same agents ({sorted(costs.engines)} there)")
    plan = plan_placement(config, nodes)
    return plan, simulate(plan, config.pipeline, costs, nodes, steps)
