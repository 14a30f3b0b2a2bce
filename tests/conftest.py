"""Shared fixtures: the built-in tiny model, a real local Ray, and small experiment configs."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import yaml

from marl_pipeline.config import ExperimentConfig, parse_config

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def demo_config_data() -> dict:
    return yaml.safe_load((ROOT / "configs" / "demo.yaml").read_text())


def small_config_data(base: dict, store: Path, **pipeline) -> dict:
    """The demo config cut down to seconds: few prompts, few steps, short warm-up."""
    data = copy.deepcopy(base)
    data["store"] = str(store)
    data["pipeline"].update({"steps": 2, "prompts_per_micro_batch": 4, "samples_per_prompt": 4,
                             "micro_batches_per_step": 2, **pipeline})
    for agent in data["agents"].values():
        agent["warmup"] = {"steps": 30}
    return data


@pytest.fixture
def small_config(demo_config_data: dict, tmp_path: Path) -> ExperimentConfig:
    return parse_config(small_config_data(demo_config_data, tmp_path / "store"))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from environments.arithmetic import ArithmeticCheck, ArithmeticOptions
    from marl_pipeline.models import build_tiny_model

    env = ArithmeticCheck(ArithmeticOptions())
    directory = tmp_path_factory.mktemp("tiny") / "model"
    return build_tiny_model(directory, env.text_corpus(np.random.default_rng(0), 500), seed=0)


@pytest.fixture(scope="module")
def local_ray():
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()
