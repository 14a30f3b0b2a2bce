"""Asset checks of the stage assets, per partition: schema version, finite values, staleness, token ids.

Each check reads the stored partition through the experiment's store (marl_pipeline.store.validation does the
work), so it runs with a stage asset's materialization from Dagster and on its own for any partition.
"""

import warnings

import dagster as dg

from assets.partitions import STAGE_PARTITIONS, parse_stage_partition
from assets.stages import environment_results, policy_updates, rewards, rollouts
from resources import ExperienceStoreResource, ExperimentResource


def _result(outcome) -> dg.AssetCheckResult:
    return dg.AssetCheckResult(passed=outcome.passed, description=outcome.description, metadata=outcome.metadata)


def _partition_check(asset: dg.AssetsDefinition, name: str, description: str, run_check):
    """An asset check of ``asset`` per stage partition; ``run_check(store, stage, key, config)`` returns an outcome."""
    stage = asset.key.path[-1]

    def _check(context: dg.AssetCheckExecutionContext, experiment: ExperimentResource,
               store: ExperienceStoreResource) -> dg.AssetCheckResult:
        from marl_pipeline.store import MicroBatchKey

        key = MicroBatchKey(*parse_stage_partition(context.partition_key))
        return _result(run_check(store.open(), stage, key, experiment.load()))

    # Partitioned asset checks are a preview feature of dagster 1.13; they are what lets a check run for one
    # (step, micro-batch) partition, so the preview warning is silenced here and only here.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", dg.PreviewWarning)
        return dg.asset_check(asset=asset, name=name, description=description,
                              partitions_def=STAGE_PARTITIONS)(_check)


def _schema_version(store, stage, key, config):
    from marl_pipeline.store.validation import check_schema_version

    return check_schema_version(store, stage, key)


def _finite(store, stage, key, config):
    from marl_pipeline.store.validation import check_finite

    return check_finite(store, stage, key)


def _staleness(store, stage, key, config):
    from marl_pipeline.store.validation import check_staleness

    return check_staleness(store, key, config.staleness_bounds())


def _token_ids(store, stage, key, config):
    from marl_pipeline.store.validation import check_token_ids

    return check_token_ids(store, key)


STAGE_CHECKS = [
    *(_partition_check(asset, "schema_version", "Manifest and files carry the current schema version.",
                       _schema_version) for asset in (rollouts, environment_results, rewards, policy_updates)),
    _partition_check(rollouts, "finite_logprobs", "No NaN or inf in the rollout logprobs.", _finite),
    _partition_check(rewards, "finite_rewards", "No NaN or inf in rewards or advantages.", _finite),
    _partition_check(rollouts, "staleness_within_bound",
                     "Every turn's step - policy_version is within 0..pipeline.staleness.", _staleness),
    _partition_check(rollouts, "token_ids_in_vocabulary",
                     "Prompt and response token ids lie in [0, vocab_size) of the agent's policy.", _token_ids),
]
