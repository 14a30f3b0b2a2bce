"""The ``health`` asset: every agent's training-health signals at one step (marl_pipeline/stages/health.py).

Partitioned like ``evaluations`` (``<run>-<step>``): the train job records it as each step ends, and its numeric
metadata per agent is what the UI plots across steps; materializing a partition from the UI recomputes a step's
signals from the store (its gradient norms are known only to the launch that stepped, so they stay empty).
"""

import dagster as dg

from assets.evaluations import parse_version_key
from assets.partitions import STEPS
from resources import ExperienceStoreResource, ExperimentResource


def health_metadata(health: dict[str, dict[str, float | None]]) -> dict[str, dg.MetadataValue]:
    """Every agent's signals as numbers (``<agent>/<signal>``); a signal the step lacks is left out."""
    return {f"{agent}/{name}": dg.MetadataValue.float(round(float(value), 4))
            for agent, signals in health.items() for name, value in signals.items() if value is not None}


@dg.asset(partitions_def=STEPS, group_name="evaluation", deps=["policies"], kinds={"parquet"})
def health(context: dg.AssetExecutionContext, experiment: ExperimentResource,
           store: ExperienceStoreResource) -> dg.MaterializeResult:
    """Per agent at the step: zero-variance GRPO groups, answer diversity, token entropy, response length and
    truncation, loss, clip fraction, engine-vs-trainer mismatch, gradient norm; from the stored partitions."""
    from marl_pipeline.stages.health import commit_step_health, signals_by_agent

    run, step = parse_version_key(context.partition_key)
    agents = experiment.load().agents
    table = commit_step_health(store.open(), run, step, {agent: step + 1 for agent in agents}, {})
    return dg.MaterializeResult(metadata=health_metadata(signals_by_agent(table)))
