"""Asset checks of the stage partitions: pass on good data, fail naming the problem, runnable alone in Dagster."""

from __future__ import annotations

from pathlib import Path

import dagster as dg
import numpy as np
import pyarrow as pa
import yaml

from assets.checks import STAGE_CHECKS
from assets.partitions import add_planned_stage_partitions, stage_partition
from assets.stages import STAGE_ASSETS
from marl_pipeline.store import ExperienceStore, MicroBatchKey
from marl_pipeline.store.validation import check_finite, check_schema_version, check_staleness, check_token_ids
from resources import ExperienceStoreResource, ExperimentResource, RayCluster
from tests.stored_run import VOCAB, write_run


def _damage_rollouts(store: ExperienceStore, key: MicroBatchKey) -> None:
    """Re-commit a partition with a NaN logprob, a turn too stale and a token id outside the vocabulary."""
    table = store.read("rollouts", key)
    logprobs = table.column("logprobs").to_pylist()
    logprobs[0][1] = float("nan")
    versions = table.column("policy_version").to_pylist()
    versions[1] = key.step - 5
    ids = table.column("response_ids").to_pylist()
    ids[2][0] = VOCAB + 7
    for name, values in (("logprobs", logprobs), ("policy_version", versions), ("response_ids", ids)):
        index = table.column_names.index(name)
        table = table.set_column(index, name, pa.array(values, table.schema.field(name).type))
    store.commit("rollouts", key, table)


def test_checks_pass_on_good_data_and_name_what_is_wrong(tmp_path: Path) -> None:
    store = ExperienceStore(tmp_path)
    write_run(store)
    key = MicroBatchKey("r", 1, 0)
    for outcome in (check_schema_version(store, "rollouts", key), check_finite(store, "rollouts", key),
                    check_finite(store, "rewards", key), check_staleness(store, key, bound=1),
                    check_token_ids(store, key)):
        assert outcome.passed, outcome.description
    assert not check_staleness(store, key, bound=0).passed  # step 1 sampled with version 0
    # each agent held to its own bound (agents.<a>.staleness): only the agent at 0 fails
    assert check_staleness(store, key, bound={"solver": 1, "verifier": 1}).passed
    assert not check_staleness(store, key, bound={"solver": 1, "verifier": 0}).passed
    _damage_rollouts(store, key)
    finite = check_finite(store, "rollouts", key)
    assert not finite.passed and finite.metadata["non_finite/logprobs"] == 1
    stale = check_staleness(store, key, bound=1)
    assert not stale.passed and "staleness 1..5 outside 0..1" in stale.description
    tokens = check_token_ids(store, key)
    assert not tokens.passed and f"solver: token ids 0..{VOCAB + 7} outside [0, {VOCAB})" in tokens.description
    rewards = store.read("rewards", key)
    store.commit("rewards", key, rewards.set_column(rewards.column_names.index("advantage"), "advantage",
                                                    pa.array(np.full(rewards.num_rows, np.inf), pa.float32())))
    assert "NaN or inf values: {'advantage': 8}" in check_finite(store, "rewards", key).description


def test_checks_run_on_their_own_for_a_partition_in_dagster(tmp_path: Path, demo_config_data: dict) -> None:
    store = ExperienceStore(tmp_path / "store")
    write_run(store, run="demo")
    _damage_rollouts(store, MicroBatchKey("demo", 1, 1))
    config_path = tmp_path / "experiment.yaml"
    config_path.write_text(yaml.safe_dump({**demo_config_data, "store": str(tmp_path / "store"),
                                           "pipeline": {**demo_config_data["pipeline"], "staleness": 1}}))
    experiment = ExperimentResource(config_path=str(config_path))
    resources = {"experiment": experiment, "store": ExperienceStoreResource(experiment=experiment),
                 "ray": RayCluster(experiment=experiment)}
    instance = dg.DagsterInstance.ephemeral()
    add_planned_stage_partitions(instance, "demo", 1, 1, micro_batches=2)  # as the train job plans them
    written = dg.AssetSelection.checks_for_assets(*STAGE_ASSETS[:3])  # the synthetic run has no policy_updates
    results = {}
    for micro_batch in (0, 1):
        partition = stage_partition("demo", 1, micro_batch)
        # The checks alone for one partition, as the UI's "Execute checks" runs them (partition given by run tags).
        tags = {"dagster/partition": partition}
        result = dg.materialize([*STAGE_ASSETS, *STAGE_CHECKS], selection=written, instance=instance, tags=tags,
                                resources=resources)
        assert result.success
        evaluations = result.get_asset_check_evaluations()
        assert not result.get_asset_materialization_events()  # the checks alone: nothing recomputed
        results[micro_batch] = {e.asset_check_key.to_user_string(): e.passed for e in evaluations}
    assert len(results[0]) == 7 and all(results[0].values()), results[0]
    assert {name for name, passed in results[1].items() if not passed} == {
        "rollouts:finite_logprobs", "rollouts:staleness_within_bound", "rollouts:token_ids_in_vocabulary"}
