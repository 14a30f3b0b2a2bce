"""`marl prepare`: version 0 of every agent made once, before a first launch (what `make train` runs), and left as
it is when the store has it; `marl profile threads` times an agent's trainer from that version 0."""

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

    # what a trainer's threads buy, measured on the verifier's version 0 with its trainer settings: a thread profile
    # marl plan reads (planner/threads.py)
    from marl_pipeline.planner.threads import thread_profile

    profile = tmp_path / "threads.json"
    timed = _marl("profile", "threads", str(config), "--agent", "verifier", "--threads", "1", "--threads", "2",
                  "--reps", "1", "--out", str(profile))
    assert timed.returncode == 0, timed.stdout + timed.stderr
    assert "verifier's trainer on 16 rows" in timed.stdout and f"thread profile written to {profile}" in timed.stdout
    scaling = thread_profile(profile)
    assert scaling.speedup(1) == 1.0 and scaling.speedup(2) > 0
    unprepared = config.with_name("unprepared.yaml")
    unprepared.write_text(yaml.safe_dump({**data, "store": str(tmp_path / "empty")}))
    refused = _marl("profile", "threads", str(unprepared), "--out", str(profile))
    assert refused.returncode == 2 and "no version 0 of solver" in refused.stdout and "marl prepare" in refused.stdout
    refused = _marl("profile", "threads", str(config), "--threads", "2", "--threads", "4", "--reps", "1", "--out",
                    str(profile))
    assert refused.returncode == 2 and "needs the counts 1, 2, ... n, not [2, 4]" in refused.stdout


def _marl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "assets.cli", *args], capture_output=True, text=True, timeout=600,
                          cwd=ROOT, env={**os.environ, "COLUMNS": "200"})
