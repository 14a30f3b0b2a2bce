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
    """What a trainer's threads buy on these CPUs (``marl profile threads``' file); empty: linear."""
    gpu: str = ""
    """A GPU kind (h100, h200, a100): engine and trainer costs from a roofline on it, the workload from the run."""
    profile: str = ""
    """With ``gpu``: the trainers' MFU from this ``bench/engines/gpu_trainer.py --rl`` output instead of the
    roofline's."""
    engine_profiles: dict[str, str] = Field(default_factory=dict)
    """With ``gpu``: agent -> ``marl profile engine``'s output, that agent's engine costs, not the roofline's."""
    by_length: bool = False
    """With ``gpu``: each agent's engine tensor parallelism and trainer workers by range of context length."""
    search: bool = False
    """Try allocations (replicas, tensor parallelism, trainer workers, staleness, micro-batches): the best few."""
    steps: int = 5
    """Steps to simulate."""


@dg.asset(group_name="planning", kinds={"simpy"})
def capacity_plan(context: dg.AssetExecutionContext, config: CapacityPlanConfig, experiment: ExperimentResource,
                  store: ExperienceStoreResource) -> dg.MaterializeResult:
    """The experiment's predicted step time, steps an hour, each actor's busy share, the staleness of its turns and
    what bounds the step, by a simulation of this orchestrator on its placement plan (a projection, not a
    measurement: the simulation's assumptions are in the metadata)."""
    from assets.plots import busy_png, images_markdown
    from marl_pipeline.config import parse_config
    from marl_pipeline.planner.capacity import plan_capacity

    data, source = experiment.data()  # read once: the search varies the mapping the config is made from
    settings = parse_config(data, source=source)
    summary = plan_capacity(settings, data, store.open(), config.calibrate_runs or settings.run,
                            cluster=config.cluster or None, steps=config.steps, gpu=config.gpu or None,
                            profile=config.profile or None, threads_profile=config.threads_profile or None,
                            engine_profiles=config.engine_profiles, by_length=config.by_length, search=config.search)
    context.log.info(f"capacity plan: {summary['step_seconds']:.2f} s a step on {summary['nodes']}, bound by "
                     f"{summary['bound']} (costs: {summary['costs']})")
    extra = {key: dg.MetadataValue.json(summary[key]) for key in ("by_length", "search") if key in summary}
    return dg.MaterializeResult(metadata={
        "step_seconds": dg.MetadataValue.float(round(summary["step_seconds"], 4)),
        "steps_per_hour": dg.MetadataValue.float(round(summary["steps_per_hour"], 1)),
        "bound": dg.MetadataValue.text(summary["bound"]),
        "cluster": dg.MetadataValue.text(config.cluster or summary["nodes"]),
        "costs": dg.MetadataValue.text(summary["costs"]),
        "staleness": dg.MetadataValue.json({str(k): v for k, v in sorted(summary["staleness"].items())}),
        "placement": dg.MetadataValue.json(summary["placement"]),
        "busy": images_markdown({"predicted busy share": busy_png(summary["busy"])}),
        "calibration_error": dg.MetadataValue.json(summary["calibration_error"]),
        "assumptions": dg.MetadataValue.md("\n".join(f"- {line}" for line in summary["assumptions"])),
        **extra,
    })
