"""The Dagster layer end to end on a real instance, real Ray and real vLLM engines.

One small `train` run (2 steps x 2 micro-batches) is shared by the tests of this module: the
partitions it records, the policy versions, the CLI's view of it, and per-partition replays.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import dagster as dg
import pyarrow as pa
import pytest
import yaml

from assets.checks import STAGE_CHECKS
from assets.definitions import defs
from assets.evaluations import evaluations
from assets.partitions import agent_key, planned_stage_partitions, stage_partition, step_key
from assets.stages import environment_results, policy_updates, rewards, rollouts
from marl_pipeline.store import ExperienceStore, MicroBatchKey
from marl_pipeline.store.schema import STAGES
from resources import ExperienceStoreResource, ExperimentResource, RayCluster
from tests.conftest import ROOT, hybrid_agents, small_config_data

pytestmark = pytest.mark.launch

STEPS, MICRO_BATCHES = 2, 2


# The run is launched as from the launchpad: the YAML file says otherwise, the run config's overrides decide. The
# verifier samples, is scored and trains with settings of its own (agents.<a>.algorithm): one-token verdicts, RLOO.
VERIFIER_ALGORITHM = {"max_new_tokens": 1, "temperature": 0.7, "advantage": {"type": "rloo"}, "entropy_coef": 0.01}
OVERRIDES = {"run": "small", "pipeline": {"steps": STEPS, "micro_batches_per_step": MICRO_BATCHES},
             "agents": {"verifier": {"algorithm": VERIFIER_ALGORITHM}}}


@pytest.fixture(scope="module")
def trained(tmp_path_factory, demo_config_data):
    work = tmp_path_factory.mktemp("train_job")
    data = small_config_data(hybrid_agents(demo_config_data), work / "store", steps=STEPS + 1,
                             micro_batches_per_step=MICRO_BATCHES + 1)
    data["run"] = "from_the_file"
    config_path = work / "small.yaml"
    config_path.write_text(yaml.safe_dump(data))
    (work / "dagster_home").mkdir()
    instance = dg.DagsterInstance.local_temp(str(work / "dagster_home"))
    experiment = ExperimentResource(config_path=str(config_path), overrides=OVERRIDES)
    resources = {"experiment": experiment, "store": ExperienceStoreResource(experiment=experiment),
                 "ray": RayCluster(experiment=experiment, ray_init_options={"include_dashboard": False, "num_cpus": 2})}
    result = defs.get_job_def("train").execute_in_process(instance=instance, run_config={
        "resources": {"experiment": {"config": {"config_path": str(config_path), "overrides": OVERRIDES}}}})
    yield {"result": result, "instance": instance, "store": ExperienceStore(data["store"]), "work": work,
           "config_path": config_path, "resources": resources}
    instance.dispose()


def _materialized_partitions(instance: dg.DagsterInstance, asset: str) -> list[str]:
    records = instance.fetch_materializations(dg.AssetKey(asset), limit=1000).records
    return [record.asset_materialization.partition for record in records]


def test_every_stage_partition_is_recorded_as_it_commits(trained) -> None:
    assert trained["result"].success
    instance = trained["instance"]
    expected = sorted(stage_partition("small", s, m) for s in range(STEPS) for m in range(MICRO_BATCHES))
    for stage in STAGES:
        assert sorted(_materialized_partitions(instance, stage)) == expected, stage
    record = instance.fetch_materializations(dg.AssetKey("rewards"), limit=1).records[0]
    metadata = record.asset_materialization.metadata
    expected_metadata = {"dagster/row_count", "stage_latency_s", "path", "mean_reward/solver", "mean_reward/verifier",
                         "dagster/column_schema", "sample_turns", "reward_histogram", "schema_version"}
    assert expected_metadata <= set(metadata)
    rollout_metadata = instance.fetch_materializations(dg.AssetKey("rollouts"), limit=1).records[0]
    assert rollout_metadata.asset_materialization.metadata["tokens"].value > 0
    assert Path(metadata["path"].value).is_dir()


def test_run_config_overrides_reach_the_run(trained) -> None:
    store = trained["store"]
    assert store.runs() == ["small"]  # the overridden run name, not the file's
    rollouts_table = store.read_stage("small", "rollouts", columns=["step", "micro_batch"])
    assert set(rollouts_table.column("step").to_pylist()) == set(range(STEPS))
    assert set(rollouts_table.column("micro_batch").to_pylist()) == set(range(MICRO_BATCHES))


def test_the_partition_grid_lists_exactly_what_the_run_planned(trained) -> None:
    instance, result = trained["instance"], trained["result"]
    # The launch's plan, as the op recorded it: the policy versions (from, to] each agent's launch commits.
    observations = [event.asset_observation_data.asset_observation for event in result.get_asset_observation_events()]
    plans = {(o.metadata["launch_from_version"].value, o.metadata["launch_to_version"].value)
             for o in observations if o.asset_key == dg.AssetKey("policies")}
    [(first_version, last_version)] = plans
    planned = planned_stage_partitions("small", first_version, last_version - 1, MICRO_BATCHES)
    assert len(planned) == STEPS * MICRO_BATCHES
    for asset in (rollouts, environment_results, rewards, policy_updates):
        assert asset.partitions_def.get_partition_keys(dynamic_partitions_store=instance) == planned, asset.key
        assert sorted(_materialized_partitions(instance, asset.key.path[-1])) == planned  # and each one exists
    # The evaluations' keys: the versions the launch started from or committed, each evaluable from the UI.
    assert evaluations.partitions_def.get_partition_keys(dynamic_partitions_store=instance) == [
        step_key("small", version) for version in range(first_version, last_version + 1)]


def test_a_new_policy_version_per_step_and_agent(trained) -> None:
    instance, store = trained["instance"], trained["store"]
    for agent in ("solver", "verifier"):
        records = instance.fetch_materializations(dg.AssetKey("policies"), limit=100).records
        mine = [r.asset_materialization.metadata for r in records
                if r.asset_materialization.partition == agent_key("small", agent)]
        assert sorted(metadata["policy_version"].value for metadata in mine) == [1, 2]
        # The trainer's throughput of the step that made the version: real tokens a second, MFU in percent.
        for metadata in mine:
            assert metadata["trainer_computed_tokens"].value >= metadata["tokens"].value > 0
            assert metadata["trainer_tokens_per_s"].value > 0 and 0 < metadata["mfu_percent"].value < 100
        assert store.policy_versions("small", agent) == [0, 1, 2]
    assert _materialized_partitions(instance, "base_policies") == [None]


def test_each_step_records_every_agents_health_as_stored(trained) -> None:
    """The ``health`` materialization of each step holds what the store's ``health`` partition holds, which is what
    the step's stored partitions give again (gradient norms aside: only the launch that stepped knows them)."""
    from marl_pipeline.stages.health import HEALTH_SIGNALS, TRAINER_SIGNALS, step_health

    instance, store = trained["instance"], trained["store"]
    records = instance.fetch_materializations(dg.AssetKey("health"), limit=100).records
    assert sorted(r.asset_materialization.partition for r in records) == [step_key("small", s) for s in range(STEPS)]
    for record in records:
        step = int(record.asset_materialization.partition.rsplit("-", 1)[1])
        stored = store.read("health", MicroBatchKey("small", step, 0)).to_pylist()
        again = step_health(store, "small", step, {"solver": step + 1, "verifier": step + 1}, {},
                            MICRO_BATCHES).to_pylist()
        metadata = record.asset_materialization.metadata
        for row, recomputed in zip(stored, again):
            assert row["policy_version"] == step + 1 and row["groups"] == MICRO_BATCHES * 4
            assert row["grad_norm"] > 0 and row["trainer_tokens_per_s"] > 0 and 0 < row["mfu"] < 1
            assert all(recomputed[name] is None for name in TRAINER_SIGNALS)
            for name in HEALTH_SIGNALS:
                if name not in TRAINER_SIGNALS:
                    assert row[name] == pytest.approx(recomputed[name], rel=1e-6), name
                assert metadata[f"{row['agent']}/{name}"].value == pytest.approx(row[name], abs=1e-4), name


def test_store_holds_every_turn_with_its_policy_version(trained) -> None:
    store = trained["store"]
    rollouts_table = store.read_stage("small", "rollouts")
    # 2 steps x 2 micro-batches x 4 prompts x 4 samples episodes, 2 turns each
    assert rollouts_table.num_rows == STEPS * MICRO_BATCHES * 4 * 4 * 2
    for step in range(STEPS):
        versions = set(rollouts_table.filter(pa.compute.field("step") == step).column("policy_version").to_pylist())
        assert versions == {step}  # staleness 0: step i samples from version i
    rewards_table = store.read_stage("small", "rewards")
    assert rewards_table.num_rows == rollouts_table.num_rows
    assert set(rewards_table.column("sample_id").to_pylist()) == set(rollouts_table.column("sample_id").to_pylist())


def test_each_agent_samples_and_is_scored_by_its_own_algorithm(trained) -> None:
    """The verifier's own settings (``VERIFIER_ALGORITHM``, from the run config) reached its engine and its
    estimator; the solver kept the experiment's."""
    from marl_pipeline.config import GRPOAdvantage, RLOOAdvantage, parse_config
    from marl_pipeline.environment import build_environment
    from marl_pipeline.run.launches import RECORD
    from marl_pipeline.stages.reward import score_micro_batch

    store = trained["store"]
    lengths = {agent: pa.compute.list_value_length(store.read_stage("small", "rollouts", columns=["response_ids"],
                                                                    filter=pa.compute.field("agent") == agent)
                                                   .column("response_ids")).to_pylist()
               for agent in ("solver", "verifier")}
    assert set(lengths["verifier"]) == {1} and max(lengths["solver"]) > 1  # a verdict and no end token: cut at 1
    record = store.read_record("small", RECORD)
    [config_data] = record["configs"].values()
    config = parse_config(config_data)
    assert config.algorithm_of("verifier").advantage == RLOOAdvantage()
    assert config.algorithm_of("solver") == config.algorithm
    env = build_environment(config.environment.name, config.environment.options)
    key = MicroBatchKey("small", 1, 0)
    stored = store.read("rewards", key)
    for agent, advantage in (("solver", GRPOAdvantage()), ("verifier", RLOOAdvantage())):
        alone = score_micro_batch(env, store.read("rollouts", key), store.read("environment_results", key),
                                  advantage=advantage)
        mine = pa.compute.field("agent") == agent
        assert (_sorted(alone.filter(mine)).column("advantage").equals(
            _sorted(stored.filter(mine)).column("advantage"))), agent


def _sorted(table: pa.Table) -> pa.Table:
    return table.sort_by([("sample_id", "ascending")] if "sample_id" in table.column_names
                         else [("agent", "ascending")])


@pytest.mark.parametrize("asset", [environment_results, rewards, policy_updates], ids=lambda a: a.key.path[-1])
def test_rematerialized_stage_reproduces_its_stored_partition(trained, asset) -> None:
    stage = asset.key.path[-1]
    store, key = trained["store"], MicroBatchKey("small", 1, 1)
    before = _sorted(store.read(stage, key))
    checks = [check for check in STAGE_CHECKS if next(iter(check.check_keys)).asset_key == asset.key]
    result = dg.materialize([asset, *checks], partition_key=stage_partition("small", 1, 1),
                            instance=trained["instance"], resources=trained["resources"])
    assert result.success
    # The stage's asset checks run with its materialization, on the replayed partition, and pass.
    evaluations = result.get_asset_check_evaluations()
    assert len(evaluations) == len(checks) and all(e.passed for e in evaluations), evaluations
    after = _sorted(store.read(stage, key))
    assert after.num_rows == before.num_rows
    for name in before.column_names:
        # when the stage ran and how long its work took: a replay runs later, at another speed
        if name.endswith(("_start", "_end", "_seconds")) or name.startswith("stage_"):
            continue
        if name == "loss_sum":  # float reductions: the same inputs and order, compared to float64 rounding
            assert after.column(name).to_pylist() == pytest.approx(before.column(name).to_pylist(), rel=1e-6)
        else:
            assert after.column(name).equals(before.column(name)), name


def test_rematerialized_rollout_resamples_the_stored_micro_batch(trained) -> None:
    store, key = trained["store"], MicroBatchKey("small", 1, 0)
    before = _sorted(store.read("rollouts", key))
    checks = [check for check in STAGE_CHECKS if next(iter(check.check_keys)).asset_key == rollouts.key]
    result = dg.materialize([rollouts, *checks], partition_key=stage_partition("small", 1, 0),
                            instance=trained["instance"], resources=trained["resources"])
    assert result.success
    evaluations = result.get_asset_check_evaluations()
    assert len(evaluations) == 4 and all(e.passed for e in evaluations), evaluations
    after = _sorted(store.read("rollouts", key))
    for name in ("sample_id", "prompt_text", "policy_version", "prompt_ids"):
        assert after.column(name).equals(before.column(name)), name
    # Per-request seeds and the stored policy version: the same samples come back.
    assert after.column("response_ids").equals(before.column("response_ids"))


def test_inspect_summarises_the_stored_run(trained) -> None:
    result = subprocess.run([sys.executable, "-m", "assets.cli", "inspect", str(trained["store"].root),
                             "--run", "small"], capture_output=True, text=True, timeout=120, cwd=ROOT,
                            env={**os.environ, "COLUMNS": "160"})
    assert result.returncode == 0, result.stderr
    assert f"{STEPS} steps, {STEPS * MICRO_BATCHES * 16} episodes" in result.stdout
    assert "mean reward per step" in result.stdout
    assert "training health per step" in result.stdout and "zero-var" in result.stdout


def test_workspace_loads_without_warnings(tmp_path: Path) -> None:
    (tmp_path / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    result = subprocess.run([str(Path(sys.executable).parent / "dagster"), "definitions", "validate",
                             "-w", "workspace.yaml"], capture_output=True, text=True, timeout=300, cwd=ROOT,
                            env={"DAGSTER_HOME": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stdout + result.stderr
    assert "All code locations passed validation" in result.stdout + result.stderr
    log_lines = [line for line in (result.stdout + result.stderr).splitlines()
                 if "WARNING" in line or "Warning:" in line]
    assert [line for line in log_lines if "SupersessionWarning" not in line] == []


def test_the_run_and_its_partitions_show_plots_and_conversations(trained) -> None:
    instance = trained["instance"]
    [record] = instance.fetch_materializations(dg.AssetKey("training_runs"), limit=10).records
    run = record.asset_materialization
    assert run.partition == "small" and run.metadata["episodes_per_s"].value > 0
    # No evaluation section in this run: the plots of the store's reward and staleness, and the launch's activity.
    assert re.findall(r"!\[([^\]]*)\]\(data:image/png;base64,", run.metadata["plots"].value) == [
        "reward per step", "staleness per step", "stage activity"]
    rewards = instance.fetch_materializations(dg.AssetKey("rewards"), limit=1).records[0].asset_materialization
    assert re.search(r"\*\*solver\*\* \(turn 0, policy v\d, reward -?\d\.\d{3}, advantage [+-]\d\.\d{3}\)",
                     rewards.metadata["episodes"].value)


def test_the_trainers_passes_are_in_the_runs_log_once(trained) -> None:
    """With the first step, the run's log (and so the ``marl`` CLI) says once, in one short line for the agents that
    share it, how the trainers run their passes: packed or padded, the token budget and where it came from, the
    device and precision."""
    from assets.train import STEP_PREFIX

    entries = trained["instance"].all_logs(trained["result"].run_id)
    lines = [entry.user_message for entry in entries
             if entry.user_message.startswith(STEP_PREFIX) and "passes of" in entry.user_message]
    passes = r"padded passes of [\d,]+ tokens \((the CPU's default|set)\) on cpu, \w+"
    assert len(lines) == 1 and re.fullmatch(rf"step 0: trainers of solver, verifier: {passes}", lines[0]), lines


def test_each_set_up_phase_is_in_the_runs_log_as_it_ends(trained) -> None:
    """The launch's set-up shows in the run's log, phase by phase with its seconds, before the first stage commits
    (what the ``marl`` CLI prints while the progress bar says "setting up")."""
    from assets.train import SETUP_PREFIX

    entries = trained["instance"].all_logs(trained["result"].run_id)
    lines = [entry.user_message for entry in entries if entry.user_message.startswith(SETUP_PREFIX)]
    words = [line.split(" (")[0].removeprefix(SETUP_PREFIX).split(" ")[0] for line in lines]
    # Ray's start (the resource), then the launch's phases; each engine and trainer as it comes up, in any order.
    assert words[:3] == ["embedded", "placement", "version"] and words[-1] == "engines", lines
    assert sorted(words[3:-1]) == ["engine", "engine", "trainer", "trainer"], lines
    assert all(re.search(r"\(\d+\.\d s\)$", line) for line in lines), lines
    first_commit = next(i for i, entry in enumerate(entries)
                        if entry.dagster_event is not None and entry.dagster_event.is_step_materialization)
    assert max(i for i, entry in enumerate(entries) if entry.user_message in lines) < first_commit


def test_each_version_shows_its_card_and_exports_with_what_the_store_holds(trained, tmp_path: Path) -> None:
    """The launch record names the Dagster run that trained the run; each version's ``policies`` materialization
    shows its card's summary; ``marl export --all-agents`` writes each agent's release, every field as stored."""
    from typer.testing import CliRunner

    from assets.cli import app
    from tests.test_policy_cards import assert_release_matches_store

    instance, store, run_id = trained["instance"], trained["store"], trained["result"].run_id
    commit = store.read_record("small", "launch.json")["launches"][0]["commit"]
    for record in instance.fetch_materializations(dg.AssetKey("policies"), limit=100).records:
        agent = record.asset_materialization.partition.removeprefix("small-")
        version = record.asset_materialization.metadata["policy_version"].value
        card = record.asset_materialization.metadata["card"].value
        teammate = "verifier" if agent == "solver" else "solver"
        assert f"**run `small`, agent `{agent}`, version {version}** (base model `builtin:tiny`)" in card
        # staleness 0: step s is served by version s
        assert f"teammates at step {version - 1}: {teammate} v{version - 1}" in card
        assert f"launches: `{run_id}` (steps 0..{STEPS - 1}, commit `{(commit or '-')[:12]}`)" in card
    out = tmp_path / "release"
    result = CliRunner().invoke(app, ["export", str(store.root), "--run", "small", "--all-agents", "--out", str(out)])
    assert result.exit_code == 0, result.output
    for agent in ("solver", "verifier"):
        assert_release_matches_store(out / agent, store, "small", agent, STEPS, MICRO_BATCHES, [run_id])
