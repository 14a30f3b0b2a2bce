"""A plugin written from docs/environments.md alone (examples/relay_plugin), installed as a user would on a fresh
clone: `make plugin P=DIR`, a training run on it through `marl train` and the Dagster `train` job, the set-up again
(its `uv sync` removes every package the lock does not name), and the CLI finding the plugin again."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import dagster as dg
import pytest
import yaml

from marl_pipeline.store import ExperienceStore

pytestmark = pytest.mark.launch

ROOT = Path(__file__).resolve().parents[1]


def _fresh_clone(target: Path) -> Path:
    """The checkout's tracked files as they are (a clean clone of the working tree), with no .venv; uv itself is
    copied from the checkout's set-up (`.uv`: pip's download of one pinned wheel, nothing of the project's)."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for name in filter(None, listed.decode().split("\0")):
        if (ROOT / name).is_file():  # deleted in the working tree: not in the clone either
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, target / name)
    shutil.copytree(ROOT / ".uv", target / ".uv", symlinks=True)
    return target


def _run(command: list[str], cwd: Path, env: dict) -> subprocess.CompletedProcess:
    result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, f"{command} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


def test_make_plugin_installs_a_plugin_that_trains_and_survives_the_set_up(tmp_path: Path) -> None:
    clone = _fresh_clone(tmp_path / "clone")
    # The clone's processes write the bytecode of what they import, and its set-ups compile none: scripts/setup.sh
    # compiles every installed package (UV_COMPILE_BYTECODE) for machines where Python writes no bytecode
    # (PYTHONDONTWRITEBYTECODE=1, as here and in CI), which the suite's own set-up does; compiling all of it costs
    # far more CPU than one launch writing what it imports (f3e7fbf).
    env = {key: value for key, value in os.environ.items()
           if key not in ("VIRTUAL_ENV", "RAY_ADDRESS", "PYTHONDONTWRITEBYTECODE")}
    env["UV_COMPILE_BYTECODE"] = "0"
    env["DAGSTER_HOME"] = str(tmp_path / "dagster_home")
    (tmp_path / "dagster_home").mkdir()
    installed = _run(["make", "plugin", "P=examples/relay_plugin"], clone, env)
    assert "installed -e " in installed.stderr
    assert (clone / "plugins.txt").read_text() == f"-e {clone / 'examples' / 'relay_plugin'}\n"

    data = {"run": "relay", "store": str(tmp_path / "store"),
            "environment": {"name": "docs_relay", "options": {"colours": 3}},
            # each agent's engine and trainer in one process, as configs/demo.yaml has them
            "agents": {role: {"warmup": {"steps": 30}, "hybrid": True} for role in ("sender", "receiver")},
            "pipeline": {"steps": 2, "prompts_per_micro_batch": 4, "samples_per_prompt": 4,
                         "micro_batches_per_step": 2}}
    (tmp_path / "relay.yaml").write_text(yaml.safe_dump(data))
    train = [str(clone / ".venv" / "bin" / "marl"), "train", str(tmp_path / "relay.yaml")]
    _run(train, tmp_path, env)  # the console script's path holds no examples/: the entry point finds the plugin
    with dg.DagsterInstance.from_config(str(tmp_path / "dagster_home")) as instance:
        partitions = {r.asset_materialization.partition
                      for r in instance.fetch_materializations(dg.AssetKey("rewards"), limit=100).records}
    assert len(partitions) == 4
    store = ExperienceStore(data["store"])
    rewards = store.read_stage("relay", "rewards", columns=["agent", "reward", "sample_id"])
    assert sorted(set(rewards.column("agent").to_pylist())) == ["receiver", "sender"]
    by_episode: dict[tuple[str, str], set] = {}  # team reward: both agents of an episode get the same reward
    for row in rewards.to_pylist():
        input_id, _turn, trajectory = row["sample_id"].split("_")
        by_episode.setdefault((input_id, trajectory), set()).add(row["reward"])
    assert len(by_episode) == 2 * 2 * 4 * 4 and all(len(values) == 1 for values in by_episode.values())
    results = store.read_stage("relay", "environment_results", columns=["outcome"]).column("outcome").to_pylist()
    assert set(results) <= {"sent", "match", "miss"}
    assert store.policy_versions("relay", "sender") == [0, 1, 2]

    (clone / ".venv" / ".marl-installed").unlink()  # the set-up syncs again, as after a change of uv.lock
    again = _run(["make", "setup"], clone, env)
    assert "reinstalling the plugins of plugins.txt" in again.stderr
    # The console script still finds the plugin: the config's environment and options resolve through its entry
    # point (the launch above showed that the run's Ray workers, in the same environment, do too).
    prepared = _run([str(clone / ".venv" / "bin" / "marl"), "prepare", str(tmp_path / "relay.yaml")], tmp_path, env)
    assert "run relay: every agent has its version 0" in prepared.stdout, prepared.stdout
