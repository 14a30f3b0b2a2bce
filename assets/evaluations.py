"""The ``evaluations`` asset: every agent's held-out metrics at one policy version, and a collapse check.

Partitioned like the stage assets' step dimension (``<run>-<version>``): the train job records the versions
it evaluates (``evaluation.every``); materializing a partition from the UI evaluates that stored version.
"""

import warnings

import dagster as dg
from pydantic import Field

from assets.partitions import STEPS
from resources import ExperienceStoreResource, ExperimentResource, RayCluster


def parse_version_key(partition_key: str) -> tuple[str, int]:
    """(run, policy version) of a ``<run>-<version>`` key."""
    run, _, version = partition_key.rpartition("-")
    if not run or not version.isdigit():
        raise ValueError(f"evaluation partition {partition_key!r} is not of the form <run>-<version>")
    return run, int(version)


def evaluation_metadata(metrics: dict[str, dict[str, float]], path, history=None) -> dict[str, dg.MetadataValue]:
    """Every agent's metrics as numbers, the partition's path and, given the run's history, a plot across
    versions."""
    metadata: dict[str, dg.MetadataValue] = {"path": dg.MetadataValue.path(str(path))}
    for agent, figures in metrics.items():
        for name, value in figures.items():
            metadata[f"{agent}/{name}"] = dg.MetadataValue.float(round(float(value), 4))
    if history:
        from assets.plots import evaluation_png, images_markdown

        metadata["history"] = images_markdown({"held-out evaluation": evaluation_png(history)})
    return metadata


@dg.asset(partitions_def=STEPS, group_name="evaluation", deps=["base_policies", "policies"],
          kinds={"vllm", "parquet"})
def evaluations(context: dg.AssetExecutionContext, experiment: ExperimentResource, store: ExperienceStoreResource,
                ray: RayCluster) -> dg.MaterializeResult:
    """Each agent's greedy answers to its own held-out cases at the partition's policy version: solver
    accuracy, verifier balanced accuracy (the plugin's metrics), answer entropy and top-answer share."""
    from marl_pipeline.run.evaluations import evaluation_history
    from marl_pipeline.stages.evaluation import stored_metrics
    from marl_pipeline.stages.recompute import recompute_stage
    from marl_pipeline.store import MicroBatchKey

    config = experiment.load()
    run, version = parse_version_key(context.partition_key)
    experience = store.open()
    path, table, _ = recompute_stage("evaluations", config, experience, MicroBatchKey(run, version, 0))
    history = evaluation_history(experience, run)
    return dg.MaterializeResult(metadata=evaluation_metadata(stored_metrics(table), path, history))


class CastsConfig(dg.Config):
    casts: list[str] = Field(default_factory=list)
    """Casts of your own, ``[NAME:]ROLE=AGENT@VERSION,...`` (as ``marl evaluate --cast``); none: trained, swapped
    and each agent's version 0 beside its teammates' at the partition's version."""


@dg.asset(partitions_def=STEPS, group_name="evaluation", deps=["policies"], kinds={"vllm"})
def team_casts(context: dg.AssetExecutionContext, config: CastsConfig, experiment: ExperimentResource,
               store: ExperienceStoreResource, ray: RayCluster) -> dg.MaterializeResult:
    """The team on held-out cases with stored policies cast in its roles (run/casts.py): trained, swapped, each
    agent's version 0 beside its teammates'; beside each, the answering role alone (``first_sample``)."""
    from marl_pipeline.environment import build_environment
    from marl_pipeline.run.casts import chosen_casts, evaluate_cast

    run, version = parse_version_key(context.partition_key)
    experiment_config = experiment.load().model_copy(update={"run": run})  # the partition's run
    casts = chosen_casts(config.casts, experiment_config.role_agents(), version)
    env = build_environment(experiment_config.environment.name, experiment_config.environment.options)
    experience, metadata = store.open(), {}
    for cast in casts:
        entry = evaluate_cast(experiment_config, env, experience, cast)
        metadata[f"{cast.name}/roles"] = dg.MetadataValue.text(cast.describe())
        for name, value in entry["metrics"].items():
            metadata[f"{cast.name}/{name}"] = dg.MetadataValue.float(round(float(value), 4))
    return dg.MaterializeResult(metadata=metadata)


def _no_collapse(context: dg.AssetCheckExecutionContext, store: ExperienceStoreResource) -> dg.AssetCheckResult:
    from marl_pipeline.stages.evaluation import COLLAPSE_SHARE, stored_metrics
    from marl_pipeline.store import MicroBatchKey

    run, version = parse_version_key(context.partition_key)
    metrics = stored_metrics(store.open().read("evaluations", MicroBatchKey(run, version, 0)))
    collapsed = {agent: figures["top_answer_share"] for agent, figures in metrics.items() if figures["collapsed"]}
    found = [f"{agent} gives one answer to {share:.0%} of its held-out cases" for agent, share in collapsed.items()]
    description = ("collapsed: " + "; ".join(found) if found
                   else f"no agent gives one answer to more than {COLLAPSE_SHARE:.0%} of its cases")
    return dg.AssetCheckResult(passed=not collapsed, description=description, metadata={
        f"top_answer_share/{agent}": figures["top_answer_share"] for agent, figures in metrics.items()})


# Partitioned asset checks are a dagster 1.13 preview feature (see assets/checks.py); silenced here only.
with warnings.catch_warnings():
    warnings.simplefilter("ignore", dg.PreviewWarning)
    no_collapsed_agent = dg.asset_check(
        asset=evaluations, name="no_collapsed_agent", partitions_def=STEPS,
        description="No agent gives the same answer to more than 95% of held-out cases whose right answers differ.",
    )(_no_collapse)
