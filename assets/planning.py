"""The ``capacity_plan`` asset: ``marl plan`` from the UI. The experiment's step time on a described cluster,
simulated with costs from a stored run (marl_pipeline/planner/), with the busy shares as a plot. A projection."""


import dagster as dg
from pydantic import Field

from resources import ExperienceStoreResource, ExperimentResource


class CapacityPlanConfig(dg.Config):
    """What to plan for: the cluster and the stored run whose timings give the costs."""

    cluster: str = ""
    """NODESxCPUS[:GPUS], e.g. 48x96:8; empty: the Ray cluster at the experiment's ``ray.address`` (or
    ``RAY_ADDRESS``), else this machine's CPUs."""
    calibrate_runs: list[str] = Field(default_factory=list)
    """The stored runs (in the experiment's store) to take costs from, each figure their mean; empty: the
    experiment's own run."""
    threads_profile: str = ""
    """What a trainer's threads buy on these CPUs (``bench/trainer_threads.py --out``'s file); empty: linear."""
    gpu: str = ""
    """A GPU kind (h100, h200, a100): engine and trainer costs from a roofline on it, the workload from the run."""
    steps: int = 5
    """Steps to simulate."""


@dg.asset(group_name="planning", kinds={"simpy"})
def capacity_plan(context: dg.AssetExecutionContext, config: CapacityPlanConfig, experiment: ExperimentResource,
                  store: ExperienceStoreResource) -> dg.MaterializeResult:
    """The experiment's predicted step time, steps an hour, each actor's busy share, the staleness of its turns and
    what bounds the step, by a simulation of this orchestrator on its placement plan (a projection, not a
    measurement: the simulation's assumptions are in the metadata)."""
    from assets.plots import busy_png, images_markdown
    from marl_pipeline.planner.plan import (
        calibration,
        describe_nodes,
        gpu_costs_for,
        planned_nodes,
        predict,
        this_machine,
    )
    from marl_pipeline.planner.threads import thread_profile

    settings = experiment.load()
    here = this_machine()
    nodes = planned_nodes(config.cluster, settings.ray.address)
    # the stored runs are taken to have run on this machine
    threads = thread_profile(config.threads_profile) if config.threads_profile else None
    costs = calibration(store.open(), config.calibrate_runs or settings.run, here, threads)
    if config.gpu:
        costs = gpu_costs_for(settings, config.gpu, costs)
    placement, prediction = predict(settings, nodes, costs, config.steps)
    context.log.info(f"capacity plan: {prediction.mean_step_seconds:.2f} s a step on {len(nodes)} node(s), bound "
                     f"by {prediction.bound} (costs: {costs.source})")
    return dg.MaterializeResult(metadata={
        "step_seconds": dg.MetadataValue.float(round(prediction.mean_step_seconds, 4)),
        "steps_per_hour": dg.MetadataValue.float(round(prediction.steps_per_hour, 1)),
        "bound": dg.MetadataValue.text(prediction.bound),
        "cluster": dg.MetadataValue.text(config.cluster or describe_nodes(nodes)),
        "costs": dg.MetadataValue.text(costs.source),
        "staleness": dg.MetadataValue.json({str(k): v for k, v in sorted(prediction.staleness.items())}),
        "placement": dg.MetadataValue.json(placement.summary()),
        "busy": images_markdown({"predicted busy share": busy_png(prediction.busy)}),
        "assumptions": dg.MetadataValue.md("\n".join(f"- {line}" for line in prediction.assumptions)),
    })
