"""LoRA agents (peft) on the built-in tiny model, without engines: adapters-only training and checkpoints, merged
weights equal to the trainer's policy, exact resume (AdamW included), retention, and the errors of a wrong lineage.
The engine side on a real model is tests/test_lora_sync.py."""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

import pytest
import torch

from marl_pipeline.cluster.engines import engine_dirs
from marl_pipeline.cluster.specs import BASE_POLICY, trainer_options
from marl_pipeline.config import ConfigError, LoraAdapterConfig, RetentionConfig, parse_config
from marl_pipeline.policy.checkpoint import load_policy
from marl_pipeline.policy.lora import LoraCheckpointError, merged_checkpoint
from marl_pipeline.store import ExperienceStore
from marl_pipeline.store.experience import StoreError
from marl_pipeline.training.batches import TrainBatch
from marl_pipeline.training.losses import pad_sequences, token_logprobs
from marl_pipeline.training.trainer import TRAINER_STATE, PolicyTrainer
from tests.conftest import small_config_data

PROMPT, RESPONSE = [5, 6, 7, 1], [8, 9, 2, 2]
LORA = LoraAdapterConfig(rank=4, alpha=8.0).model_dump()
PARAMETER_TOLERANCE = 1e-6


def _trainer(directory: Path, version: int, base_dir: Path | None, lora: dict | None = LORA) -> PolicyTrainer:
    return PolicyTrainer(str(directory), version, lr=1e-2, weight_decay=0.01, max_grad_norm=1.0, clip_eps=0.2, seed=0,
                         num_threads=1, lora=lora, base_dir=None if base_dir is None else str(base_dir))


def _step(trainer: PolicyTrainer, advantage: float) -> None:
    trainer.accumulate(TrainBatch([[5, 6, 7], [9, 4]], [[8, 9], [3, 3, 2]], [[-1.0, -2.0], [-0.5, -1.0, -1.5]],
                                  [advantage, -advantage]))
    trainer.apply_step()


def _plain_logprobs(weights, base_dir: Path) -> list[float]:
    """Logprobs of a plain transformers model holding ``weights``: what an engine computes once it loads them."""
    model, _ = load_policy(str(base_dir))
    model.load_state_dict(dict(weights), strict=True)  # every name a plain model has, and no other
    input_ids, attention_mask, mask = pad_sequences([PROMPT], [RESPONSE], 0)
    with torch.no_grad():
        return token_logprobs(model, input_ids, attention_mask)[0][mask[0].bool()].tolist()


def _max_difference(a: list[tuple[str, torch.Tensor]], b: list[tuple[str, torch.Tensor]]) -> float:
    assert [name for name, _ in a] == [name for name, _ in b]
    return max((x - y).abs().max().item() for (_, x), (_, y) in zip(a, b))


def test_only_adapters_train_and_a_version_stores_only_them(tiny_model_dir: Path, tmp_path: Path) -> None:
    trainer = _trainer(tiny_model_dir, 0, None)
    trainable = [name for name, param in trainer.model.named_parameters() if param.requires_grad]
    assert trainable and all(".lora_A." in name or ".lora_B." in name for name in trainable)
    before = dict(trainer.named_weights())
    base = dict(load_policy(str(tiny_model_dir))[0].state_dict())
    assert before.keys() == base.keys()  # plain Hugging Face names, as an engine loads them
    assert max((before[n] - base[n]).abs().max().item() for n in base) == 0.0  # B = 0: version 0 is the base
    for advantage in (1.0, -0.5):
        _step(trainer, advantage)
    after = dict(trainer.named_weights())
    changed = {name for name in base if not torch.equal(after[name], base[name])}
    assert changed and all(name.endswith("_proj.weight") for name in changed)  # linear layers only, not embeddings
    frozen = {name.replace(".base_layer.", "."): t for name, t in trainer.model.get_base_model().state_dict().items()
              if ".lora_" not in name}
    assert all(torch.equal(frozen[name], base[name]) for name in base)  # the trainer's base is never merged into

    trainer.save(str(tmp_path / "lora"))
    full = _trainer(tiny_model_dir, 0, None, lora=None)
    _step(full, 1.0)
    full.save(str(tmp_path / "full"))
    files = sorted(p.name for p in (tmp_path / "lora").iterdir())
    assert "model.safetensors" not in files and {"adapter_config.json", "adapter_model.safetensors",
                                                 TRAINER_STATE} <= set(files)
    size = {kind: sum(p.stat().st_size for p in (tmp_path / kind).iterdir()) for kind in ("lora", "full")}
    assert size["lora"] * 4 < size["full"], size
    moments = torch.load(tmp_path / "lora" / TRAINER_STATE, weights_only=True)["optimizer"]["state"]
    assert len(moments) == len(trainable)  # AdamW's state is the adapters', nothing of the frozen base


def test_merged_weights_serve_the_trainers_policy(tiny_model_dir: Path, tmp_path: Path) -> None:
    trainer = _trainer(tiny_model_dir, 0, None)
    for advantage in (1.0, -0.5, 2.0):
        _step(trainer, advantage)
    expected = trainer.completion_logprobs(PROMPT, RESPONSE)
    served = _plain_logprobs(trainer.named_weights(), tiny_model_dir)
    assert max(abs(a - b) for a, b in zip(expected, served)) <= 1e-5
    assert max(abs(a - b) for a, b in zip(expected, _plain_logprobs(load_policy(str(tiny_model_dir))[0]
                                                                     .state_dict().items(), tiny_model_dir))) > 1e-3
    trainer.save(str(tmp_path / "v3"))
    # what an engine starting at version 3 loads: the base with the stored adapters merged in
    assert _max_difference(merged_checkpoint(str(tiny_model_dir), str(tmp_path / "v3")),
                           trainer.named_weights()) <= PARAMETER_TOLERANCE


def test_a_lora_trainer_resumed_from_its_adapters_continues_exactly(tiny_model_dir: Path, tmp_path: Path) -> None:
    advantages = (1.0, -0.5, 2.0)
    straight = _trainer(tiny_model_dir, 0, None)
    for advantage in advantages:
        _step(straight, advantage)
    resumed, directory = _trainer(tiny_model_dir, 0, None), tiny_model_dir
    for version, advantage in enumerate(advantages):  # a new trainer from each saved version, as a resumed launch
        if version:
            resumed = _trainer(directory, version, tiny_model_dir)
            assert resumed.resumed_optimizer
        _step(resumed, advantage)
        directory = tmp_path / f"version={version + 1}"
        resumed.save(str(directory))
    assert _max_difference(straight.named_weights(), resumed.named_weights()) <= PARAMETER_TOLERANCE
    # and the moments mattered: the same adapters with AdamW restarted end elsewhere
    fresh = _trainer(tmp_path / "version=2", 2, tiny_model_dir)
    fresh.optimizer = torch.optim.AdamW([p for p in fresh.model.parameters() if p.requires_grad], lr=1e-2,
                                        weight_decay=0.01)
    _step(fresh, advantages[-1])
    assert _max_difference(straight.named_weights(), fresh.named_weights()) > 1e-4


def test_a_wrong_lineage_is_refused_with_what_is_wrong(tiny_model_dir: Path, tmp_path: Path) -> None:
    lora = _trainer(tiny_model_dir, 0, None)
    _step(lora, 1.0)
    lora.save(str(tmp_path / "adapters"))
    full = _trainer(tiny_model_dir, 0, None, lora=None)
    _step(full, 1.0)
    full.save(str(tmp_path / "full"))
    with pytest.raises(LoraCheckpointError, match=r"version 1 is a full fine-tuning checkpoint.*has `lora`"):
        _trainer(tmp_path / "full", 1, tiny_model_dir)
    with pytest.raises(ValueError, match=r"holds LoRA adapters, not a full model"):
        _trainer(tmp_path / "adapters", 1, None, lora=None)
    with pytest.raises(LoraCheckpointError, match=r"base policy \(the agent's version 0\) is not at None"):
        _trainer(tmp_path / "adapters", 1, None)
    with pytest.raises(LoraCheckpointError, match=r"rank 4, alpha 8.0, but the agent's `lora` asks for rank 16"):
        _trainer(tmp_path / "adapters", 1, tiny_model_dir, lora={**LORA, "rank": 16})


def test_lora_and_full_agents_in_one_config(demo_config_data: dict, tiny_model_dir: Path, tmp_path: Path) -> None:
    data = small_config_data(demo_config_data, tmp_path / "store")
    data["agents"]["solver"]["lora"] = {"rank": 4, "target_modules": ["q_proj", "v_proj"]}
    config = parse_config(data)
    store = ExperienceStore(config.store)
    solver, verifier = (trainer_options(config.agent_slice(agent)) for agent in ("solver", "verifier"))
    assert solver["lora"] == {"rank": 4, "alpha": 16.0, "target_modules": ["q_proj", "v_proj"]}
    assert solver["base_dir"] == BASE_POLICY  # version 0, fetched where the trainer is built
    assert verifier["lora"] is None and verifier["base_dir"] is None

    for agent, trainer in (("solver", _trainer(tiny_model_dir, 0, None, lora=solver["lora"])),
                           ("verifier", _trainer(tiny_model_dir, 0, None, lora=None))):
        shutil.copytree(tiny_model_dir, store.policy_dir("demo", agent, 0))
        _step(trainer, 1.0)
        trainer.save(str(store.policy_dir("demo", agent, 1)))
    # an engine starting at version 1 loads the solver's base and merges its adapters, the verifier's weights as is
    assert engine_dirs(store, "demo", "solver", 1) == (str(store.policy_dir("demo", "solver", 0)),
                                                       str(store.policy_dir("demo", "solver", 1)))
    assert engine_dirs(store, "demo", "verifier", 1) == (str(store.policy_dir("demo", "verifier", 1)), None)
    assert engine_dirs(store, "demo", "solver", 0) == (str(store.policy_dir("demo", "solver", 0)), None)


@pytest.mark.parametrize(("lora", "field"), [({"rank": 0}, "agents.solver.lora.rank"),
                                             ({"target_modules": []}, "agents.solver.lora.target_modules"),
                                             ({"dropout": 0.1}, "agents.solver.lora.dropout")])
def test_bad_lora_settings_name_the_field(demo_config_data: dict, lora: dict, field: str) -> None:
    data = copy.deepcopy(demo_config_data)
    data["agents"]["solver"]["lora"] = lora
    with pytest.raises(ConfigError) as error:
        parse_config(data)
    assert f"  {field}:" in str(error.value)


def test_retention_keeps_a_lora_agents_base_and_names_a_pruned_version(tiny_model_dir: Path, tmp_path: Path) -> None:
    store = ExperienceStore(str(tmp_path / "store"))
    shutil.copytree(tiny_model_dir, store.policy_dir("r", "solver", 0))
    trainer = _trainer(store.policy_dir("r", "solver", 0), 0, None)
    for version in range(1, 6):
        _step(trainer, 1.0 if version % 2 else -1.0)
        staging = store.staging_policy_dir("r", "solver", version)
        trainer.save(str(staging))
        store.commit_policy(staging, "r", "solver", version)
    assert store.prune_policies("r", "solver", RetentionConfig(keep_last=2, keep_every=None)) == [1, 2, 3]
    assert store.policy_versions("r", "solver") == [0, 4, 5]
    base, adapters = engine_dirs(store, "r", "solver", 5)
    assert _max_difference(merged_checkpoint(base, adapters), trainer.named_weights()) <= PARAMETER_TOLERANCE
    with pytest.raises(StoreError, match=r"policy version 2 of agent 'solver' in run 'r' is not stored.*\[0, 4, 5\]"):
        store.require_policy("r", "solver", 2)
