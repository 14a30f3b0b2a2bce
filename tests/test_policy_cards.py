"""Policy cards: the launch record's history of launches (ids, steps, code commit, config without credentials), the
served versions a launch notes as it commits, and the check that an exported release says what the store holds
(used on the trained runs of tests/test_train_job.py and tests/test_evaluation.py)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import yaml
from typer.testing import CliRunner

from assets.cli import app
from marl_pipeline.config import parse_config
from marl_pipeline.run.launches import RECORD, finish_launch, plan_launch, run_overview
from marl_pipeline.run.provenance import ServedVersions
from marl_pipeline.stages.evaluation import stored_metrics
from marl_pipeline.stages.health import stored_collapse
from marl_pipeline.store import ExperienceStore, MicroBatchKey
from tests.conftest import ROOT, small_config_data
from tests.stored_run import write_run


def _head() -> str | None:
    """The checkout's commit as git tells it (None outside a checkout, as the launch record then holds)."""
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def test_the_launch_record_keeps_every_launch_and_its_config_without_credentials(demo_config_data: dict,
                                                                                tmp_path: Path) -> None:
    store = ExperienceStore(tmp_path / "store")
    write_run(store, "demo", steps=1)  # version 0 of both agents
    data = small_config_data(demo_config_data, tmp_path / "unused", steps=3)
    data["store"] = {"uri": "s3://bucket/prefix", "endpoint_url": "https://minio:pw@minio.example:9000",
                     "access_key_id": "AKIA-ID", "secret_access_key": "the-secret"}
    data["tracking"] = {"mlflow": "https://alice:hunter2@mlflow.example/path"}
    config = parse_config(data)
    # A record written before the history: it still reads, and the first new launch adds to it.
    store.write_record("demo", RECORD, {"last_step": 4, "finished": True})
    assert run_overview(store, "demo").state == "finished"
    plan = plan_launch(store, config, "dagster-run-1", started=0.0)
    record = store.read_record("demo", RECORD)
    [launch] = record["launches"]
    assert (plan.first_step, plan.last_step, plan.resumed) == (0, 2, False)
    assert launch == {"id": "dagster-run-1", "started_at": "1970-01-01T00:00:00+00:00", "first_step": 0,
                      "last_step": 2, "resumed": False, "commit": _head(), "config": launch["config"],
                      "finished": False}
    recorded = record["configs"][launch["config"]]
    assert recorded["store"] | {"retention": None} == {
        "uri": "s3://bucket/prefix", "endpoint_url": "https://***@minio.example:9000", "region": None,
        "access_key_id": "***", "secret_access_key": "***", "policy_cache": None, "compression": "zstd",
        "retention": None}
    assert recorded["tracking"]["mlflow"] == "https://***@mlflow.example/path"
    assert recorded["agents"] == config.model_dump(mode="json")["agents"]
    text = json.dumps(record)
    assert [word for word in ("the-secret", "AKIA-ID", "hunter2", "minio:pw") if word in text] == []
    # Killed, then resumed under another id: the history keeps both, one config between them.
    resumed = plan_launch(store, config, None)
    finish_launch(store, "demo", resumed.last_step)
    record = store.read_record("demo", RECORD)
    assert resumed.resumed and [(launch["id"], launch["resumed"], launch["finished"])
                                for launch in record["launches"]] == [("dagster-run-1", False, False),
                                                                      (None, True, True)]
    assert len(record["configs"]) == 1 and (record["last_step"], record["finished"]) == (2, True)
    assert run_overview(store, "demo").target_step == 2


def test_the_trackers_get_the_config_without_credentials(demo_config_data: dict, tmp_path: Path) -> None:
    """MLflow's parameters and the wandb run's config, as each writes them (a sqlite MLflow store, wandb's offline
    files), hold none of the store's credentials."""
    from mlflow import MlflowClient

    from marl_pipeline.run.tracking import MetricsExport, wandb_run_id
    from tests.test_evaluation import wandb_records

    data = small_config_data(demo_config_data, tmp_path / "unused")
    data["store"] = {"uri": "s3://bucket/prefix", "endpoint_url": "https://minio:pw@minio.example:9000",
                     "access_key_id": "AKIA-ID", "secret_access_key": "the-secret"}
    data["tracking"] = {"mlflow": f"sqlite:///{tmp_path / 'mlflow.db'}", "wandb": {"dir": str(tmp_path / "wandb")}}
    config = parse_config(data)
    export = MetricsExport(config)
    export.close(finished=True)
    client = MlflowClient(config.tracking.mlflow)
    [run] = client.search_runs([client.get_experiment_by_name("marl-pipeline").experiment_id])
    assert run.data.params["store.secret_access_key"] == "***" and run.data.params["store.access_key_id"] == "***"
    [file] = (tmp_path / "wandb" / "wandb").glob(f"offline-run-*-{wandb_run_id(config.run)}/run-*.wandb")
    logged = b"".join(record.SerializeToString() for record in wandb_records(file))
    assert b"AKIA-ID" not in logged and b"the-secret" not in logged and b"minio:pw" not in logged
    assert b"s3://bucket/prefix" in logged  # the config is there, its secrets are not
    params = json.dumps(run.data.params)
    assert [word for word in ("the-secret", "AKIA-ID", "minio:pw") if word in params] == []


def test_served_versions_read_only_what_the_launch_did_not_commit(tmp_path: Path) -> None:
    store = ExperienceStore(tmp_path / "store")
    write_run(store, "r", steps=3)  # step s served by version max(s - 1, 0)
    served = ServedVersions(store, "r", micro_batches=2)
    seen = pa.table({"agent": ["solver", "verifier"], "policy_version": pa.array([7, 8], pa.int32())})
    served.add(MicroBatchKey("r", 2, 0), seen)  # micro-batch 1 only in the store
    assert served.at(2) == {"solver": [1, 7], "verifier": [1, 8]}
    assert served.at(0) == {"solver": [0], "verifier": [0]}
    served.forget(2)
    assert served.at(2) == {"solver": [1], "verifier": [1]}


def test_export_names_one_agent_or_every_agent(tmp_path: Path) -> None:
    runner = CliRunner()
    for flags in ([], ["--agent", "solver", "--all-agents"]):
        result = runner.invoke(app, ["export", str(tmp_path), "--run", "r", "--out", str(tmp_path / "o"), *flags])
        assert result.exit_code == 2 and "--agent, or export every agent with --all-agents" in result.output


def assert_release_matches_store(out: Path, store: ExperienceStore, run: str, agent: str, version: int,
                                 micro_batches: int, launch_ids: list[str | None]) -> dict:
    """Every field of an exported release's ``provenance.json``, and its card's tables, as the store holds them."""
    provenance = json.loads((out / "provenance.json").read_text())
    card = (out / "README.md").read_text()
    assert (provenance["run"], provenance["agent"], provenance["version"]) == (run, agent, version)
    assert (out / "config.json").is_file() and provenance["store"] == store.uri
    # Steps 0..v-1: the agent's policy_updates rows, one per micro-batch
    updates = store.read_stage(run, "policy_updates", columns=["step", "micro_batch", "agent", "rows", "tokens"])
    mine = sorted((r["step"], r["micro_batch"], r["rows"], r["tokens"]) for r in updates.to_pylist()
                  if r["agent"] == agent and r["step"] < version)
    assert len(mine) == version * micro_batches and provenance["steps_missing"] == []
    assert [(s["step"], m["micro_batch"], m["rows"], m["tokens"])
            for s in provenance["steps"] for m in s["micro_batches"]] == mine
    assert (provenance["rows"], provenance["tokens"]) == (sum(m[2] for m in mine), sum(m[3] for m in mine))
    rollouts = store.read_stage(run, "rollouts", columns=["step", "agent", "policy_version"])
    for step in provenance["steps"]:
        assert (step["rows"], step["tokens"]) == (sum(m["rows"] for m in step["micro_batches"]),
                                                  sum(m["tokens"] for m in step["micro_batches"]))
        at_step = rollouts.filter(pc.field("step") == step["step"]).to_pylist()
        served = {name: sorted({r["policy_version"] for r in at_step if r["agent"] == name})
                  for name in {r["agent"] for r in at_step}}
        assert step["sampled_versions"] == served.pop(agent) and step["teammates"] == served and served
        teammates = "; ".join(f"{name} " + ", ".join(f"v{v}" for v in found) for name, found in served.items())
        assert f"| {step['step']} | {micro_batches} | {step['rows']} | {step['tokens']} |" in card
        assert teammates in card
    # The held-out evaluation of the version and the health of the step that made it
    key = MicroBatchKey(run, version, 0)
    if store.is_committed("evaluations", key):
        metrics = stored_metrics(store.read("evaluations", key))
        assert provenance["evaluation"] == {"metrics": metrics[agent], "team": metrics.get("team")}
        assert all(f"| {agent} | {name} |" in card for name in metrics[agent])
    else:
        assert provenance["evaluation"] is None and f"Version {version} was not evaluated." in card
    [health] = [row for row in store.read("health", MicroBatchKey(run, version - 1, 0)).to_pylist()
                if row.pop("agent") == agent]
    assert health.pop("step_finished") is not None  # when the launch finished the step: not a health signal
    assert provenance["health"] == {"step": version - 1, **health}
    # The launches that ran those steps, the code they ran and the config of the last
    record = store.read_record(run, RECORD)
    assert [launch["id"] for launch in provenance["launches"]] == launch_ids
    assert provenance["launches"] == [launch for launch in record["launches"] if launch["first_step"] < version]
    made_by = provenance["launches"][-1]
    assert made_by["finished"] and made_by["commit"] == provenance["commit"] == _head()
    assert provenance["config"] == record["configs"][made_by["config"]]
    assert provenance["config"]["run"] == run and provenance["base_model"] == provenance["config"]["agents"][agent][
        "model"]
    # the settings the agent trained with, and those it set itself (agents.<a>.algorithm)
    config = parse_config(provenance["config"])
    own = {name for name, value in config.agents[agent].algorithm.model_dump().items() if value is not None}
    assert provenance["algorithm"] == {"settings": config.algorithm_of(agent).model_dump(mode="json"),
                                       "own": sorted(own)}
    assert all(f"| {name} | " in card for name in provenance["algorithm"]["settings"])
    assert card.count("| the agent |") == len(own)
    # the warnings the version's training raised, as its launch's health settings read them
    mine = [warning for warning in stored_collapse(store, run, version - 1, config.health)
            if warning.startswith(f"{agent} ")]
    assert provenance["warnings"] == mine and all(f"- {warning}" in card for warning in mine)
    assert ("No warning was raised at that step" in card) == (not mine)
    front = yaml.safe_load(card.split("---\n")[1])
    assert front["marl_pipeline"] == {"run": run, "agent": agent, "roles": [agent], "version": version,
                                      "steps": version, "tokens": provenance["tokens"], "commit": _head(),
                                      "launches": launch_ids}
    assert all(f"| {launch['id'] or '-'} | {launch['started_at']} |" in card for launch in provenance["launches"])
    return provenance

