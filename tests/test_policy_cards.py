"""Policy cards: the launch record's history of launches (ids, steps, code commit, config without credentials)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from marl_pipeline.config import parse_config
from marl_pipeline.run.launches import RECORD, finish_launch, plan_launch, run_overview
from marl_pipeline.store import ExperienceStore
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
