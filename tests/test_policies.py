"""Base policies: the built-in tiny model, or any local Hugging Face model directory, through one loading path."""

from __future__ import annotations

import copy
from pathlib import Path

from marl_pipeline.config import parse_config
from marl_pipeline.environment import build_environment
from marl_pipeline.runtime.models import load_policy
from marl_pipeline.runtime.policies import latest_versions, prepare_base_policies
from marl_pipeline.store import ExperienceStore


def test_builtin_model_is_built_warmed_up_and_kept(small_config) -> None:
    env = build_environment(small_config.environment.name, small_config.environment.options)
    store = ExperienceStore(small_config.store)
    created = prepare_base_policies(small_config, env, store)
    assert [p.created for p in created] == [True, True]
    assert all(p.warmup_loss[1] < p.warmup_loss[0] for p in created)
    model, tokenizer = load_policy(str(created[0].path))
    assert model.config.head_dim == 64 and model.config.model_type == "qwen2"
    assert tokenizer.eos_token == "<|endoftext|>"
    again = prepare_base_policies(small_config, env, store)  # a lineage is never overwritten
    assert [p.created for p in again] == [False, False]
    assert latest_versions(store, small_config.run, ["solver", "verifier"]) == {"solver": 0, "verifier": 0}


def test_a_local_hugging_face_directory_loads_the_same_way(demo_config_data, tiny_model_dir: Path,
                                                           tmp_path: Path) -> None:
    data = copy.deepcopy(demo_config_data)
    data["store"] = str(tmp_path / "store")
    for agent in data["agents"].values():
        agent.update(model=str(tiny_model_dir), warmup={"steps": 0})
    config = parse_config(data)
    env = build_environment(config.environment.name, config.environment.options)
    store = ExperienceStore(config.store)
    policies = prepare_base_policies(config, env, store)
    original, _ = load_policy(str(tiny_model_dir))
    copied, _ = load_policy(str(policies[0].path))
    for (name, a), (_, b) in zip(original.state_dict().items(), copied.state_dict().items()):
        assert a.equal(b), name  # no warm-up: version 0 is the given model
