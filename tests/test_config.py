"""Configs: every shipped one parses; bad ones fail before anything runs, naming the field."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from marl_pipeline.config import ConfigError, load_config, parse_config

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_parses(path: Path) -> None:
    config = load_config(path)
    assert config.agents and config.pipeline.steps >= 1


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda d: d["agents"].update(critic={}), "agents.critic"),
        (lambda d: d["environment"].update(name="chess"), "environment.name"),
        (lambda d: d["pipeline"].update(prompts_per_batch=3), "pipeline.prompts_per_batch"),
        (lambda d: d.update(learning_rate=1.0), "learning_rate"),
        (lambda d: d["agents"]["solver"].setdefault("trainer", {}).update(lr=-1), "agents.solver.trainer.lr"),
        (lambda d: d["environment"]["options"].update(max_operand="many"), "environment.options.max_operand"),
        (lambda d: d["agents"].pop("verifier"), "agents"),
        (lambda d: d.setdefault("algorithm", {}).update(kl_coef=-0.1), "algorithm.kl_coef"),
        (lambda d: d.setdefault("algorithm", {}).update(entropy_coef=-1e-3), "algorithm.entropy_coef"),
        (lambda d: d.setdefault("algorithm", {}).update(loss_normalization="batch"), "algorithm.loss_normalization"),
        (lambda d: d.setdefault("algorithm", {}).update(tis_cap=0.5), "algorithm.tis_cap"),
        (lambda d: d.setdefault("algorithm", {}).update(kl_penalty=0.1), "algorithm.kl_penalty"),
        (lambda d: d["agents"]["solver"].setdefault("trainer", {}).update(dtype="float16"),
         "agents.solver.trainer.dtype"),
    ],
)
def test_bad_config_names_the_field(demo_config_data: dict, change, field: str) -> None:
    data = copy.deepcopy(demo_config_data)
    change(data)
    with pytest.raises(ConfigError) as error:
        parse_config(data)
    assert f"  {field}:" in str(error.value)


def test_cli_rejects_bad_config_before_writing_anything(demo_config_data: dict, tmp_path: Path) -> None:
    data = copy.deepcopy(demo_config_data)
    data["agents"]["critic"] = {"model": "builtin:tiny"}
    data["store"] = str(tmp_path / "store")
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    result = subprocess.run([sys.executable, "-m", "assets.cli", "train", str(path)], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "agents.critic: unknown agent" in result.stdout + result.stderr
    assert not (tmp_path / "store").exists()
    assert not (tmp_path / ".dagster_home").exists()


@pytest.mark.parametrize(
    ("verifier", "message"),
    [
        ({"turn_adapters": {"verdict": [1]}}, "turn_adapters needs the agent's lora"),
        ({"lora": {}, "turn_adapters": {"a": [1], "b": [1]}}, "a turn is served by one adapter at most"),
        ({"lora": {}, "turn_adapters": {"default": [1]}}, "'default' is the name of the RL adapters"),
        ({"lora": {}, "turn_adapters": {"two words": [1]}}, "String should match pattern"),
        ({"lora": {}, "warmup": {"steps": 4, "lora": {}, "adapter": "verdict"}}, "warmup.adapter 'verdict' serves no"),
        ({"warmup": {"steps": 4, "adapter": "verdict"}}, "it needs warmup.lora"),
        ({"warmup": {"steps": 4, "lora": {}, "separate": True}}, "warmup.separate is now warmup.adapter"),
        ({"warmup": {"steps": 4, "rehearse_context": True}}, "warmup.rehearse_context was removed"),
    ],
)
def test_named_adapter_settings_are_checked(demo_config_data: dict, verifier: dict, message: str) -> None:
    data = copy.deepcopy(demo_config_data)
    data["agents"]["verifier"].update(verifier)
    with pytest.raises(ConfigError, match=message):
        parse_config(data)
