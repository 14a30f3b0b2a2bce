"""The stage assets, one partition per planned micro-batch (`<run>-<step>-<micro_batch>`, assets/partitions.py).

The streaming ``train`` job records every partition as it is committed; materializing one of these
assets (from the UI or a backfill) recomputes that stage for that stored micro-batch from its stored
inputs, with the same stage function.
"""


import dagster as dg

from assets.metadata import stage_metadata
from assets.partitions import STAGE_PARTITIONS, parse_stage_partition
from assets.previews import PREVIEW_COLUMNS
from resources import ExperienceStoreResource, ExperimentResource, RayCluster

_GROUP = "stages"


def _recompute(stage: str, context: dg.AssetExecutionContext, experiment: ExperimentResource,
               store: ExperienceStoreResource) -> dg.MaterializeResult:
    from marl_pipeline.stages.recompute import recompute_stage
    from marl_pipeline.store import MicroBatchKey

    key = MicroBatchKey(*parse_stage_partition(context.partition_key))
    experience = store.open()
    path, table, seconds = recompute_stage(stage, experiment.load(), experience, key)
    rollouts = experience.read("rollouts", key, columns=PREVIEW_COLUMNS) if stage == "rewards" else None
    return dg.MaterializeResult(metadata=stage_metadata(stage, path, seconds, table, rollouts))


@dg.asset(partitions_def=STAGE_PARTITIONS, group_name=_GROUP, deps=["base_policies"], kinds={"vllm", "parquet"})
def rollouts(context: dg.AssetExecutionContext, experiment: ExperimentResource, store: ExperienceStoreResource,
             ray: RayCluster) -> dg.MaterializeResult:
    """Multi-turn episodes sampled from every agent's vLLM engine: one row per turn."""
    return _recompute("rollouts", context, experiment, store)


# Ray is required, not only used: with Ray up the recomputation runs an action environment's actions on the
# shared action pool (isolated worker processes, as in the train job) instead of in Dagster's step process.
@dg.asset(partitions_def=STAGE_PARTITIONS, group_name=_GROUP, deps=[rollouts], kinds={"parquet"})
def environment_results(context: dg.AssetExecutionContext, experiment: ExperimentResource,
                        store: ExperienceStoreResource, ray: RayCluster) -> dg.MaterializeResult:
    """The outcome of executing each turn's action."""
    return _recompute("environment_results", context, experiment, store)


@dg.asset(partitions_def=STAGE_PARTITIONS, group_name=_GROUP, deps=[rollouts, environment_results],
          kinds={"parquet"})
def rewards(context: dg.AssetExecutionContext, experiment: ExperimentResource,
            store: ExperienceStoreResource) -> dg.MaterializeResult:
    """Per-agent rewards and group-relative (GRPO) advantages."""
    return _recompute("rewards", context, experiment, store)


@dg.asset(partitions_def=STAGE_PARTITIONS, group_name=_GROUP, deps=[rollouts, rewards], kinds={"torch", "parquet"})
def policy_updates(context: dg.AssetExecutionContext, experiment: ExperimentResource,
                   store: ExperienceStoreResource) -> dg.MaterializeResult:
    """Each agent's gradient accumulation for the micro-batch (loss, tokens, clip fraction)."""
    return _recompute("policy_updates", context, experiment, store)


STAGE_ASSETS = [rollouts, environment_results, rewards, policy_updates]
