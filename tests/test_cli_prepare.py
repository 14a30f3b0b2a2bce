"""`marl prepare`: version 0 of every agent made once, before a first launch (what `make train` runs), and left as
it is when the store has it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from marl_pipeline.store import ExperienceStore
from tests.conftest import small_config_data

pytestmark = pytest.mark.launch

ROOT = Path(__file__).resolve().parents[1]


def _prepare(config: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "assets.cli", "prepare", str(config)], capture_output=True, text=True,
                          timeout=600, cwd=ROOT, env={**os.environ, "COLUMNS": "200"})


def test_prepare_makes_each_missing_version_0_once(demo_config_data: dict, tmp_path: Path) -> None:
    data = small_config_data(demo_config_data, tmp_path / "store")
    data["ray"] = {"num_cpus": 2}
    config = tmp_path / "experiment.yaml"
    config.write_text(yaml.safe_dump(data))
    made = _prepare(config)
    assert made.returncode == 0, made.stdout + made.stderr
    assert "version 0 of solver made, warm-up loss" in made.stdout and "version 0 of verifier made" in made.stdout
    store = ExperienceStore(str(tmp_path / "store"))
    assert [store.policy_versions(data["run"], agent) for agent in ("solver", "verifier")] == [[0], [0]]
    weights = store.policy_dir(data["run"], "solver", 0) / "model.safetensors"
    written = weights.stat().st_mtime_ns
    again = _prepare(config)
    assert again.returncode == 0 and "every agent has its version 0" in again.stdout
    assert weights.stat().st_mtime_ns == written  # a run's lineage is never overwritten
    bad = config.with_name("bad.yaml")
    bad.write_text(yaml.safe_dump({**data, "pipeline": {"stepz": 1}}))
    refused = _prepare(bad)
    assert refused.returncode == 2 and "pipeline.stepz" in refused.stdout
