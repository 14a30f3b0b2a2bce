"""The ``health`` asset: every agent's training-health signals at one step (marl_pipeline/stages/health.py).

Partitioned like ``evaluations`` (``<run>-<step>``): the train job records it as each step ends, and its numeric
metadata per agent is what the UI plots across steps; materializing a partition from the UI recomputes a step's
signals from the store (its trainer's figures, gradient norms, tokens/s and MFU, are known only to the launch that
stepped, so they stay empty).
"""

import warnings

import dagster as dg

from assets.evaluations import parse_version_key
from assets.partitions import STEPS
from marl_pipeline.config import HealthConfig
from resources import ExperienceStoreResource, ExperimentResource


def health_metadata(health: dict[str, dict[str, float | None]]) -> dict[str, dg.MetadataValue]:
    """Every agent's signals as numbers (``<agent>/<signal>``); a signal the step lacks is left out."""
    return {f"{agent}/{name}": dg.MetadataValue.float(round(float(value), 4))
            for agent, signals in health.items() for name, value in signals.items() if value is not None}


@dg.asset(partitions_def=STEPS, group_name="evaluation", deps=["policies"], kinds={"parquet"})
def health(context: dg.AssetExecutionContext, experiment: ExperimentResource,
           store: ExperienceStoreResource) -> dg.MaterializeResult:
    """Per agent at the step: zero-variance GRPO groups, answer diversity, token entropy, response length and
    truncation, loss, clip fraction, engine-vs-trainer mismatch, gradient norm; from the stored partitions (with the
    trainer's tokens/s and MFU when the train job records it)."""
    from marl_pipeline.stages.health import commit_step_health, signals_by_agent

    run, step = parse_version_key(context.partition_key)
    config = experiment.load()
    table = commit_step_health(store.open(), run, step, {agent: step + 1 for agent in config.agents}, {},
                               config.pipeline.micro_batches_per_step)
    return dg.MaterializeResult(metadata=health_metadata(signals_by_agent(table)))


COLLAPSE_CHECK = "no_collapse_in_training"


def collapse_evaluation(run: str, step: int, found: list[str], settings: HealthConfig) -> dg.AssetCheckEvaluation:
    """The ``health`` partition's collapse check, from what ``collapse_warnings`` found at ``step``: as the train job
    logs it when the step ends, and as the check computes it from the store."""
    from assets.partitions import step_key

    return dg.AssetCheckEvaluation(
        asset_key=dg.AssetKey("health"), check_name=COLLAPSE_CHECK, passed=not found, partition=step_key(run, step),
        severity=dg.AssetCheckSeverity.WARN,
        description="; ".join(found) if found else (
            f"over the last {settings.steps} step(s) no agent gives one response to more than "
            f"{settings.top_answer_share:.0%} of its prompts, and none has more than "
            f"{settings.zero_variance_groups:.0%} of its GRPO groups without reward variance"))


def _no_collapse(context: dg.AssetCheckExecutionContext, experiment: ExperimentResource,
                 store: ExperienceStoreResource) -> dg.AssetCheckResult:
    from marl_pipeline.stages.health import stored_collapse

    run, step = parse_version_key(context.partition_key)
    settings = experiment.load().health
    evaluation = collapse_evaluation(run, step, stored_collapse(store.open(), run, step, settings), settings)
    return dg.AssetCheckResult(passed=evaluation.passed, severity=evaluation.severity,
                               description=evaluation.description)


# Partitioned asset checks are a dagster 1.13 preview feature (see assets/checks.py); silenced here only.
with warnings.catch_warnings():
    warnings.simplefilter("ignore", dg.PreviewWarning)
    no_collapse_in_training = dg.asset_check(
        asset=health, name=COLLAPSE_CHECK, partitions_def=STEPS,
        description="No agent's training-health signals show collapse over the last steps (settings: health.*): "
                    "one response to almost every prompt, or almost no GRPO group with reward variance.",
    )(_no_collapse)
