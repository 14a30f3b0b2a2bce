"""Base policies: the built-in tiny model, or any local Hugging Face model directory, through one loading path."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from marl_pipeline.bootstrap.policies import latest_versions, prepare_base_policies
from marl_pipeline.config import parse_config
from marl_pipeline.environment import build_environment
from marl_pipeline.policy.checkpoint import load_policy
from marl_pipeline.store import ExperienceStore


@pytest.mark.launch
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


@pytest.mark.launch
@pytest.mark.parametrize("on_ray", [False, True], ids=["in-process", "ray-tasks"])
def test_a_local_hugging_face_directory_loads_the_same_way(demo_config_data, tiny_model_dir: Path, tmp_path: Path,
                                                           on_ray: bool, request) -> None:
    if on_ray:
        request.getfixturevalue("local_ray")  # each agent's version 0 in a Ray task, as the asset prepares it
    data = copy.deepcopy(demo_config_data)
    data["store"] = str(tmp_path / "store")
    for agent in data["agents"].values():
        agent.update(model=str(tiny_model_dir), warmup={"steps": 0})
    config = parse_config(data)
    env = build_environment(config.environment.name, config.environment.options)
    store = ExperienceStore(config.store)
    policies = prepare_base_policies(config, env, store, on_ray=on_ray)
    assert [(p.agent, p.created) for p in policies] == [("solver", True), ("verifier", True)]
    original, _ = load_policy(str(tiny_model_dir))
    for policy in policies:
        copied, _ = load_policy(str(policy.path))
        for (name, a), (_, b) in zip(original.state_dict().items(), copied.state_dict().items()):
            assert a.equal(b), name  # no warm-up: version 0 is the given model


def test_a_lora_warm_up_is_merged_into_a_plain_version_0(demo_config_data, tiny_model_dir: Path,
                                                          tmp_path: Path) -> None:
    """``warmup.lora``: the warm-up trains adapters and merges them, so version 0 is a plain model whose linear
    layers moved by an update of at most the adapters' rank and whose other weights are the source's."""
    import torch

    from marl_pipeline.policy.lora import is_adapter_checkpoint

    data = copy.deepcopy(demo_config_data)
    data["store"] = str(tmp_path / "store")
    for agent in data["agents"].values():
        agent.update(model=str(tiny_model_dir), warmup={"steps": 8, "batch_size": 8, "lr": 3e-3,
                                                        "lora": {"rank": 2, "alpha": 4}})
    config = parse_config(data)
    env = build_environment(config.environment.name, config.environment.options)
    policies = prepare_base_policies(config, env, ExperienceStore(config.store))
    assert policies[0].warmup_loss[1] < policies[0].warmup_loss[0]
    assert not is_adapter_checkpoint(policies[0].path)
    original = load_policy(str(tiny_model_dir))[0].state_dict()
    warmed = load_policy(str(policies[0].path))[0].state_dict()
    assert warmed.keys() == original.keys()
    changed = [name for name in original if not original[name].equal(warmed[name])]
    assert changed and all(name.endswith("proj.weight") for name in changed), changed
    for name in changed:
        assert torch.linalg.matrix_rank(warmed[name] - original[name], rtol=1e-4) <= 2, name


def _named_adapter_config(demo_config_data, tiny_model_dir: Path, store: Path, verifier: dict):
    data = copy.deepcopy(demo_config_data)
    data.update(store=str(store), environment={"name": "math_chat_worked",
                                               "options": {"prompt_format": "text", "warmup_turns": "both"}})
    for agent in data["agents"].values():
        agent.update(model=str(tiny_model_dir), warmup={"steps": 0}, lora={"rank": 2, "alpha": 4})
    data["agents"]["verifier"].update(verifier)
    return parse_config(data)


@pytest.mark.launch
def test_a_warm_up_kept_as_a_named_adapter_leaves_the_model_untouched(demo_config_data, tiny_model_dir: Path,
                                                                     tmp_path: Path) -> None:
    """``warmup.adapter``: version 0 is the model as loaded, and the warm-up's adapters are stored beside it under
    their name; a launch whose ``turn_adapters`` names an adapter version 0 lacks is refused."""
    import json

    import pytest

    from marl_pipeline.policy.lora import named_adapter_dirs

    config = _named_adapter_config(demo_config_data, tiny_model_dir, tmp_path / "store", {
        "warmup": {"steps": 8, "batch_size": 8, "lr": 3e-3, "adapter": "verdict", "lora": {"rank": 2, "alpha": 4}},
        "turn_adapters": {"verdict": [0, 1]}})
    env = build_environment(config.environment.name, config.environment.options)
    policies = {p.agent: p for p in prepare_base_policies(config, env, ExperienceStore(config.store))}
    verifier = policies["verifier"]
    assert verifier.warmup_loss[1] < verifier.warmup_loss[0]
    original = load_policy(str(tiny_model_dir))[0].state_dict()
    kept = load_policy(str(verifier.path))[0].state_dict()
    assert all(original[name].equal(kept[name]) for name in original)  # the adapters never touched the model
    adapters = named_adapter_dirs(verifier.path)
    assert list(adapters) == ["verdict"]
    assert json.loads((adapters["verdict"] / "adapter_config.json").read_text())["r"] == 2
    assert named_adapter_dirs(policies["solver"].path) == {}

    refused = _named_adapter_config(demo_config_data, tiny_model_dir, tmp_path / "other",
                                    {"turn_adapters": {"verdict": [1]}})
    with pytest.raises(ValueError, match=r"verifier.*names \['verdict'\].*holds no named adapters"):
        prepare_base_policies(refused, env, ExperienceStore(refused.store))
