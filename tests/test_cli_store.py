"""The operator's store commands: ``marl runs`` lists a store's runs, ``marl export`` writes a policy version as a
plain Hugging Face model (LoRA merged or not) that transformers loads with the trained weights."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from assets.cli import app
from marl_pipeline.config import StoreConfig
from marl_pipeline.policy.lora import merged_checkpoint
from marl_pipeline.run.launches import RECORD, run_overview
from marl_pipeline.store import ExperienceStore
from marl_pipeline.training.batches import TrainBatch
from marl_pipeline.training.trainer import PolicyTrainer

LORA = dict(rank=4, alpha=8.0, target_modules="all-linear")


def _commit(store: ExperienceStore, run: str, agent: str, version: int, source: Path) -> None:
    staging = store.staging_policy_dir(run, agent, version)
    shutil.copytree(source, staging, dirs_exist_ok=True)
    store.commit_policy(staging, run, agent, version)


def _trained(store: ExperienceStore, run: str, agent: str, tiny_model_dir: Path, lora: dict | None) -> None:
    """Version 0 (the tiny model) and version 1, one RL step on from it (full weights, or LoRA adapters)."""
    _commit(store, run, agent, 0, tiny_model_dir)
    base = store.require_policy(run, agent, 0)
    trainer = PolicyTrainer(str(base), 0, lr=1e-2, weight_decay=0.0, max_grad_norm=1.0, clip_eps=0.2, seed=0,
                            num_threads=1, lora=lora, base_dir=None if lora is None else str(base))
    trainer.accumulate(TrainBatch([[1, 2, 3], [4, 5]], [[6, 7], [8]], [[-1.0, -2.0], [-0.5]], [1.0, -1.0]))
    trainer.apply_step()
    staging = store.staging_policy_dir(run, agent, 1)
    trainer.save(str(staging))
    (staging / "timing.json").write_text("{}")
    store.commit_policy(staging, run, agent, 1)


@pytest.mark.launch
@pytest.mark.parametrize("store_config", ["local", "s3"], indirect=True)
def test_runs_lists_each_run_with_its_versions_and_state(store_config: StoreConfig, tiny_model_dir: Path) -> None:
    store = ExperienceStore(store_config)
    _trained(store, "done", "solver", tiny_model_dir, None)
    _commit(store, "done", "verifier", 0, tiny_model_dir)
    store.write_record("done", RECORD, {"last_step": 0, "finished": True})
    _commit(store, "killed", "solver", 0, tiny_model_dir)
    store.write_record("killed", RECORD, {"last_step": 4, "finished": False})
    done, killed = run_overview(store, "done"), run_overview(store, "killed")
    assert (done.versions, done.target_step, done.state) == ({"solver": 1, "verifier": 0}, 0, "finished")
    assert (killed.versions, killed.target_step, killed.state) == ({"solver": 0}, 4, "unfinished")
    assert done.last_activity is not None and abs(done.last_activity - killed.last_activity) < 600
    if store_config.uri.startswith("s3://"):
        return  # the command itself reads local stores below (S3 takes the AWS_* variables)
    # In a process of its own: Rich reads the terminal's width once per console, and an earlier test's may hold
    result = subprocess.run([sys.executable, "-m", "assets.cli", "runs", store_config.uri], capture_output=True,
                            text=True, timeout=120, cwd=Path(__file__).resolve().parents[1],
                            env={**os.environ, "COLUMNS": "200"})
    assert result.returncode == 0, result.stdout + result.stderr
    lines = {line.split("│")[1].strip(): line for line in result.stdout.splitlines() if line.count("│") > 2}
    assert "solver v1, verifier v0" in lines["done"] and "finished" in lines["done"]
    assert "solver v0" in lines["killed"] and "unfinished" in lines["killed"] and " 4 " in lines["killed"]


def test_export_writes_a_loadable_model_with_the_trained_weights(tiny_model_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    store = ExperienceStore(tmp_path / "store")
    _trained(store, "r", "full", tiny_model_dir, None)
    _trained(store, "r", "lora", tiny_model_dir, LORA)
    runner = CliRunner()

    def export(*args: str) -> str:
        result = runner.invoke(app, ["export", str(tmp_path / "store"), "--run", "r", *args])
        return f"{result.exit_code}: {' '.join(result.output.split())}"  # as one line, however rich wrapped it

    assert export("--agent", "full", "--out", str(tmp_path / "full")).startswith("0:")
    assert not {"trainer_state.pt", "timing.json"} & {p.name for p in (tmp_path / "full").iterdir()}
    stored = load_file(store.policy_dir("r", "full", 1) / "model.safetensors")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "full")
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, stored[name]), name

    # A LoRA version merged into its base: the weights an engine serving that version loads
    assert export("--agent", "lora", "--out", str(tmp_path / "merged")).startswith("0:")
    merged = dict(merged_checkpoint(str(store.policy_dir("r", "lora", 0)), str(store.policy_dir("r", "lora", 1))))
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert set(model.state_dict()) == set(merged)
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(tensor, merged[name], rtol=0, atol=1e-6, msg=name)
    assert export("--agent", "lora", "--no-merge", "--out", str(tmp_path / "adapters")).startswith("0:")
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in (tmp_path / "adapters").iterdir()}

    # Bad input is named: a directory not empty, an agent the run does not have, a version pruned or never made
    assert "is not empty: export into a new directory" in export("--agent", "full", "--out", str(tmp_path / "full"))
    assert "no policy versions of agent 'critic' in run 'r'" in export("--agent", "critic", "--out", "x")
    assert "agents there: ['full', 'lora']" in export("--agent", "critic", "--out", "x")
    assert export("--agent", "full", "--version", "7", "--out", str(tmp_path / "v7")).startswith("1:")


def test_export_all_agents_writes_one_release_each(tiny_model_dir: Path, tmp_path: Path) -> None:
    """``--all-agents``: each agent's newest version in OUT/<agent>, weights beside their card and provenance; a run
    with no stored stages or launch record says so rather than inventing them."""
    import json

    store = ExperienceStore(tmp_path / "store")
    _trained(store, "r", "full", tiny_model_dir, None)
    _trained(store, "r", "lora", tiny_model_dir, LORA)
    runner = CliRunner()
    out = tmp_path / "release"
    result = runner.invoke(app, ["export", str(tmp_path / "store"), "--run", "r", "--all-agents", "--version", "2",
                                 "--out", str(out)])
    assert result.exit_code == 1 and "has no version 2" in " ".join(result.output.split()) and not out.exists()
    result = runner.invoke(app, ["export", str(tmp_path / "store"), "--run", "r", "--all-agents", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert sorted(path.name for path in out.iterdir()) == ["full", "lora"]
    for agent, weights in (("full", "full"), ("lora", "lora merged")):
        provenance = json.loads((out / agent / "provenance.json").read_text())
        assert (provenance["agent"], provenance["version"], provenance["weights"]) == (agent, 1, weights)
        assert (provenance["steps"], provenance["steps_missing"], provenance["launches"]) == ([], [0], [])
        card = (out / agent / "README.md").read_text()
        assert card.startswith("---\nlibrary_name: transformers\n")
        assert "no policy updates of this agent for steps 0" in card
        assert {"config.json", "model.safetensors"} <= {path.name for path in (out / agent).iterdir()}
    result = runner.invoke(app, ["export", str(tmp_path / "store"), "--run", "r", "--all-agents", "--out", str(out)])
    assert result.exit_code == 1 and "is not empty" in " ".join(result.output.split())
