"""Inspection of a stored run: `marl inspect`, the DuckDB and Polars one-liners of docs/store.md, partition metadata."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import dagster as dg
import pyarrow as pa
import pyarrow.dataset as ds
import pytest

from marl_pipeline.config import StoreConfig
from marl_pipeline.store import ExperienceStore, MicroBatchKey
from marl_pipeline.store.inspection import inspect_run, sample_episodes
from tests.stored_run import write_run

ROOT = Path(__file__).resolve().parents[1]


def _inspect(*args: str, env: dict | None = None) -> str:
    result = subprocess.run([sys.executable, "-m", "assets.cli", "inspect", *args], capture_output=True,
                            text=True, timeout=120, cwd=ROOT, env={**os.environ, "COLUMNS": "200", **(env or {})})
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


@pytest.mark.launch
def test_inspect_prints_distributions_failures_and_sample_conversations(tmp_path: Path) -> None:
    store = ExperienceStore(tmp_path)
    write_run(store)
    out = _inspect(str(tmp_path), "--run", "r", "--sample", "2")
    assert "run r: 2 steps, 16 episodes, 32 turns, 96 response tokens" in out
    assert "mean reward per step" in out and "reward histogram, solver:" in out
    assert "policy staleness (step - policy_version): 0: 16 turns, 1: 16 turns" in out
    assert "per agent: solver 0: 8, 1: 8; verifier 0: 8, 1: 8" in out
    assert "failures in environment_results: 2 rows" in out and "2 x ValueError: boom" in out
    assert "failures in rewards: 2 rows" in out
    assert out.count("micro-batch") == 2  # two sample episodes, each rendered as its agents' turns
    assert "What is" in out and "solver (turn 0, policy v" in out and "verifier (turn 1, policy v" in out


def test_inspect_filters_by_step_and_agent(tmp_path: Path) -> None:
    store = ExperienceStore(tmp_path)
    write_run(store)
    report = inspect_run(store, "r", step=1, agent="solver")
    assert (report["steps"], report["episodes"], report["turns"]) == (1, 8, 8)
    assert list(report["agents"]) == ["solver"] and report["staleness"] == {1: 8}
    assert report["agents"]["solver"]["staleness"] == {1: 8}
    assert report["agents"]["solver"]["reward"]["n"] == 8 and report["failures"] == {}
    episodes = sample_episodes(store, "r", 3, step=1, agent="solver")
    assert len(episodes) == 3 and all(e["step"] == 1 for e in episodes)
    assert all([t["agent"] for t in e["turns"]] == ["solver", "verifier"] for e in episodes)
    out = _inspect(str(tmp_path), "--run", "r", "--step", "1", "--agent", "solver")
    assert "run r, step 1, agent solver: 1 steps, 8 episodes, 8 turns" in out and "failures: none" in out


@pytest.mark.launch
def test_inspect_reads_an_s3_store_with_the_standard_aws_variables(s3_endpoint: str, tmp_path: Path) -> None:
    uri = f"s3://marl/inspect-{tmp_path.name}"
    write_run(ExperienceStore(StoreConfig(uri=uri, endpoint_url=s3_endpoint, access_key_id="testing",
                                          secret_access_key="testing", region="us-east-1",
                                          policy_cache=str(tmp_path / "cache"))), steps=1)
    out = _inspect(uri, "--sample", "1", env={"AWS_ENDPOINT_URL": s3_endpoint, "AWS_ACCESS_KEY_ID": "testing",
                                              "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"})
    assert "run r: 1 steps, 8 episodes, 16 turns" in out


def test_duckdb_and_polars_one_liners(store_config: StoreConfig) -> None:
    import duckdb
    import polars as pl

    store = ExperienceStore(store_config)
    write_run(store)
    # docs/store.md: the committed view of a stage as a pyarrow dataset, queried by DuckDB and Polars.
    rewards = store.dataset("r", "rewards")  # noqa: F841 (DuckDB finds the dataset by its variable name)
    by_agent = duckdb.sql("SELECT agent, count(*) AS turns, avg(reward) AS mean FROM rewards GROUP BY agent "
                          "ORDER BY agent").fetchall()
    assert [(a, n) for a, n, _ in by_agent] == [("solver", 16), ("verifier", 16)]
    frame = pl.scan_pyarrow_dataset(store.dataset("r", "rollouts")).filter(pl.col("step") == 1) \
        .group_by("agent").agg(pl.col("response_ids").list.len().sum().alias("tokens")).sort("agent").collect()
    assert frame.to_dicts() == [{"agent": "solver", "tokens": 24}, {"agent": "verifier", "tokens": 24}]
    if store.location.local:  # a local store is also a plain hive tree for DuckDB's own reader
        glob = f"{store.uri}/run=r/stage=rewards/step=*/micro_batch=*/agent=*/*.parquet"
        count = duckdb.sql(f"SELECT count(*) FROM read_parquet('{glob}', hive_partitioning = true) "
                           "WHERE step = 1").fetchall()[0][0]
        assert count == 16
        assert pl.scan_parquet(glob, hive_partitioning=True).filter(pl.col("agent") == "solver").collect().height == 16


def test_stage_metadata_has_schema_sample_turns_and_reward_histogram(tmp_path: Path) -> None:
    from assets.metadata import stage_metadata

    store = ExperienceStore(tmp_path)
    write_run(store, steps=1, micro_batches=1)
    key = MicroBatchKey("r", 0, 0)
    metadata = stage_metadata("rewards", store.partition_path("rewards", key), 0.5, store.read("rewards", key))
    assert metadata["dagster/row_count"].value == 8
    columns = {c.name: c.type for c in metadata["dagster/column_schema"].value.columns}
    assert columns["reward"] == "float" and columns["agent"] == "string"
    sample = metadata["sample_turns"].value
    assert len(sample.records) == 3 and "reward" in sample.records[0].data
    histogram = metadata["reward_histogram"].value
    assert isinstance(metadata["reward_histogram"], dg.MarkdownMetadataValue)
    assert "| solver |" in histogram and "| verifier |" in histogram
    rollouts = stage_metadata("rollouts", "p", 0.1, store.read("rollouts", key))
    assert rollouts["tokens"].value == 24 and "tokens" in rollouts["sample_turns"].value.records[0].data


@pytest.mark.parametrize("agent", [None, "solver"])
def test_inspect_reads_only_the_filtered_partitions(tmp_path: Path, agent: str | None) -> None:
    store = ExperienceStore(tmp_path)
    write_run(store)
    # Damage every file of step 0: a report for step 1 must not open them.
    for path in (tmp_path / "run=r").glob("stage=*/step=0/*/agent=*/*.parquet"):
        path.write_bytes(b"not parquet")
    assert inspect_run(store, "r", step=1, agent=agent)["steps"] == 1
    assert store.dataset("r", "rewards").to_table(filter=ds.field("step") == 1).num_rows == 16


def _with_health(store: ExperienceStore, steps: int = 2) -> None:
    """Health partitions of write_run's steps, as a launch commits them (its trainers' figures included)."""
    import pyarrow as pa

    from marl_pipeline.stages.health import REWARD_COLUMNS, ROLLOUT_COLUMNS, health_table

    for step in range(steps):
        keys = [MicroBatchKey("r", step, m) for m in range(2)]
        rows = {stage: pa.concat_tables([store.read(stage, key, columns=columns) for key in keys]).to_pylist()
                for stage, columns in (("rollouts", ROLLOUT_COLUMNS), ("rewards", REWARD_COLUMNS))}
        trained = {agent: {"grad_norm": 12.3456 + step, "trainer_tokens_per_s": 4321.5, "mfu": 0.0123}
                   for agent in ("solver", "verifier")}
        store.commit("health", keys[0], health_table(rows["rollouts"], rows["rewards"], [],
                                                     {"solver": step + 1, "verifier": step + 1}, trained))


@pytest.mark.launch
def test_inspect_and_runs_fit_80_columns_and_give_scripts_every_column(tmp_path: Path) -> None:
    """Rendered at 80 columns no cell is cut (Rich marks a cut with an ellipsis); --wide has every signal;
    --format json and csv carry the whole health table, the trainer's throughput too."""
    import csv
    import io
    import json

    from typer.testing import CliRunner

    from assets.cli import app
    from assets.cli.tables import HEALTH_NARROW

    store = ExperienceStore(tmp_path)
    write_run(store)
    _with_health(store)
    runner = CliRunner()
    # In a process of their own: Rich reads the terminal's width once per console
    narrow = _inspect(str(tmp_path), "--run", "r", env={"COLUMNS": "80"})
    assert "…" not in narrow and max(map(len, narrow.splitlines())) <= 80
    assert all(header in narrow for header in HEALTH_NARROW.values()) and "12.3" in narrow
    assert "mismatch" not in narrow  # a signal behind --wide
    wide = _inspect(str(tmp_path), "--run", "r", "--wide", env={"COLUMNS": "250"})
    assert "mismatch" in wide and "distinct" in wide and "…" not in wide
    rows = json.loads(runner.invoke(app, ["inspect", str(tmp_path), "--run", "r", "--format", "json"]).output)
    assert len(rows) == 4 and {row["step"] for row in rows} == {0, 1}
    assert {"grad_norm", "trainer_tokens_per_s", "mfu", "mismatch_abs_logprob"} <= set(rows[0])
    assert rows[0]["mfu"] == pytest.approx(0.0123) and rows[0]["run"] == "r"
    table = list(csv.DictReader(io.StringIO(
        runner.invoke(app, ["inspect", str(tmp_path), "--run", "r", "--format", "csv", "--step", "1"]).output)))
    assert [row["agent"] for row in table] == ["solver", "verifier"] and table[0]["grad_norm"].startswith("13.3")
    bad = runner.invoke(app, ["inspect", str(tmp_path), "--format", "yaml"])
    assert bad.exit_code == 2 and "table, json, csv" in bad.output
    listed = subprocess.run([sys.executable, "-m", "assets.cli", "runs", str(tmp_path)], capture_output=True,
                            text=True, timeout=120, cwd=ROOT, env={**os.environ, "COLUMNS": "80"})
    assert listed.returncode == 0 and "…" not in listed.stdout and "solver v0" in listed.stdout
    assert json.loads(runner.invoke(app, ["runs", str(tmp_path), "--format", "json"]).output)[0]["run"] == "r"


@pytest.mark.launch
def test_runs_and_inspect_say_which_agent_is_under_a_warning_and_since_when(tmp_path: Path) -> None:
    """A verifier whose top answer passes 0.9 from step 2 on: `marl runs` names it and the step its streak started
    (by the run's own thresholds, from its launch record), `marl inspect` gives every agent a verdict."""
    import json

    from typer.testing import CliRunner

    from assets.cli import app
    from marl_pipeline.run.launches import RECORD, run_overview
    from marl_pipeline.stages.health import HEALTH_SIGNALS

    store = ExperienceStore(tmp_path)
    write_run(store)
    for step, share in enumerate([0.5, 0.6, 0.95, 0.97, 0.99]):
        rows = [{"agent": agent, "policy_version": step + 1, "groups": 4, **dict.fromkeys(HEALTH_SIGNALS),
                 "top_answer_share": share if agent == "verifier" else 0.3, "zero_variance_groups": 0.2}
                for agent in ("solver", "verifier")]
        store.commit("health", MicroBatchKey("r", step, 0), pa.Table.from_pylist(rows))
    store.write_record("r", RECORD, {"last_step": 4, "finished": False, "launches": [{"config": "c"}],
                                     "configs": {"c": {"health": {"steps": 3}}}})
    assert run_overview(store, "r").health == {"verifier": [("may be collapsing", 4)]}  # steps 2-4: three in a row
    store.write_record("r", RECORD, {"last_step": 4, "finished": False, "launches": [{"config": "c"}],
                                     "configs": {"c": {"health": {"steps": 2}}}})
    assert run_overview(store, "r").health == {"verifier": [("may be collapsing", 3)]}  # its own thresholds
    listed = subprocess.run([sys.executable, "-m", "assets.cli", "runs", str(tmp_path)], capture_output=True,
                            text=True, timeout=120, cwd=ROOT, env={**os.environ, "COLUMNS": "200"})
    assert "verifier may be collapsing since step 3" in listed.stdout
    rows = json.loads(CliRunner().invoke(app, ["runs", str(tmp_path), "--format", "json"]).output)
    assert rows[0]["health"] == {"verifier": [["may be collapsing", 3]]}
    shown = _inspect(str(tmp_path), "--run", "r")
    assert "verdict, verifier: may be collapsing since step 3" in shown
    assert "verdict, solver: no collapse warning" in shown
