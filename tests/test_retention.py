"""Complete checkpoints (AdamW and RNG saved with each version) and the retention rule that prunes old versions."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from marl_pipeline.config import RetentionConfig
from marl_pipeline.stages.recompute import recompute_stage
from marl_pipeline.store import ExperienceStore, MicroBatchKey
from marl_pipeline.store.experience import StoreError
from marl_pipeline.store.retention import retained_versions
from marl_pipeline.training.batches import TrainBatch
from marl_pipeline.training.trainer import TRAINER_STATE, PolicyTrainer
from tests.stored_run import write_run


def test_the_rule_by_hand() -> None:
    rule = RetentionConfig(keep_last=2, keep_every=25)
    assert retained_versions(range(61), rule) == {0, 25, 50, 59, 60}
    assert retained_versions(range(61), rule, protected=[7, 99]) == {0, 7, 25, 50, 59, 60}  # 99 is not stored
    assert retained_versions(range(4), RetentionConfig(keep_last=1, keep_every=None)) == {0, 3}
    assert retained_versions(range(9), RetentionConfig(keep_all=True)) == set(range(9))


def test_pruning_deletes_whole_versions_and_a_recomputation_names_the_missing_one(small_config, tmp_path) -> None:
    store = ExperienceStore(small_config.store)
    write_run(store, run=small_config.run, steps=2, micro_batches=1)  # stage partitions, and version 0
    for agent in ("solver", "verifier"):
        for version in range(1, 4):
            source = store.policy_dir(small_config.run, agent, 0)
            shutil.copytree(source, store.policy_dir(small_config.run, agent, version))
        pruned = store.prune_policies(small_config.run, agent, RetentionConfig(keep_last=1, keep_every=2))
        assert pruned == [1]
        assert store.policy_versions(small_config.run, agent) == [0, 2, 3]
    leftovers = [p.name for p in store.policy_dir(small_config.run, "solver", 0).parent.iterdir()]
    assert sorted(leftovers) == ["version=0", "version=2", "version=3"]
    # step 1's gradient was taken at version 1, which is gone: the error names it, and nothing is written
    with pytest.raises(StoreError, match=r"policy version 1 of agent 'solver' in run 'demo' is not stored"):
        recompute_stage("policy_updates", small_config, store, MicroBatchKey(small_config.run, 1, 0))
    assert not store.is_committed("policy_updates", MicroBatchKey(small_config.run, 1, 0))


def _trainer(directory: Path, version: int) -> PolicyTrainer:
    return PolicyTrainer(str(directory), version, lr=1e-2, weight_decay=0.01, max_grad_norm=1.0, clip_eps=0.2, seed=0,
                         num_threads=1)


def _step(trainer: PolicyTrainer, advantage: float) -> None:
    trainer.accumulate(TrainBatch([[5, 6, 7], [9, 4]], [[8, 9], [3, 3, 2]], [[-1.0, -2.0], [-0.5, -1.0, -1.5]],
                                  [advantage, -advantage]))
    trainer.apply_step()


def test_a_trainer_restored_from_a_checkpoint_continues_exactly(tiny_model_dir: Path, tmp_path: Path) -> None:
    straight = _trainer(tiny_model_dir, 0)
    assert not straight.resumed_optimizer  # a base policy has no trainer state: AdamW starts fresh
    for advantage in (1.0, -0.5):
        _step(straight, advantage)
    straight.save(str(tmp_path / "v2"))
    assert (tmp_path / "v2" / TRAINER_STATE).exists()
    restored = _trainer(tmp_path / "v2", 2)
    assert restored.resumed_optimizer
    moments = restored.optimizer.state_dict()["state"]
    assert moments and all(int(s["step"]) == 2 for s in moments.values())
    fresh = _trainer(tmp_path / "v2", 2)  # the same weights, but as if AdamW had been restarted
    fresh.optimizer = torch.optim.AdamW(fresh.model.parameters(), lr=1e-2, weight_decay=0.01)
    for trainer in (straight, restored, fresh):
        _step(trainer, 2.0)
    differences = {name: max((dict(straight.model.named_parameters())[n] - p).abs().max().item()
                             for n, p in other.model.named_parameters())
                   for name, other in (("restored", restored), ("fresh", fresh))}
    assert differences["restored"] <= 1e-7
    assert differences["fresh"] > 1e-4  # the moments matter: a restart would not continue the run


def test_a_trainer_state_of_another_version_is_refused(tiny_model_dir: Path, tmp_path: Path) -> None:
    trainer = _trainer(tiny_model_dir, 0)
    _step(trainer, 1.0)
    trainer.save(str(tmp_path / "v1"))
    with pytest.raises(ValueError, match="trainer state of version 1, not 5"):
        _trainer(tmp_path / "v1", 5)
