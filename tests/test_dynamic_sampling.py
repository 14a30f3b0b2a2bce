"""Dynamic sampling: an agent's zero-advantage groups are left out of its step, and the step's gradient is then the
informative groups' alone, normalised by their tokens only (hand-computed)."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from marl_pipeline.stages.training import train_batch_for, updates_table
from marl_pipeline.store import ExperienceStore, MicroBatchKey
from marl_pipeline.store.summaries import stage_summary
from marl_pipeline.training.batches import TrainBatch
from marl_pipeline.training.trainer import PolicyTrainer
from tests.stored_run import write_run

# Per agent and group (write_run: 4 episodes, groups of 2): the advantages each group's two episodes get.
ADVANTAGES = {"solver": {0: [0.0, 0.0], 1: [1.0, -1.0]}, "verifier": {0: [0.5, -0.5], 1: [0.0, 0.0]}}


@pytest.fixture
def store_and_key(tmp_path: Path) -> tuple[ExperienceStore, MicroBatchKey]:
    """write_run's micro-batch re-committed under run ``r`` with the advantages of ADVANTAGES."""
    store = ExperienceStore(tmp_path / "store")
    write_run(store, run="src", steps=1, micro_batches=1, episodes=4, failed_episode=None)
    source, key = MicroBatchKey("src", 0, 0), MicroBatchKey("r", 0, 0)
    store.commit("rollouts", key, store.read("rollouts", source))
    rewards = store.read("rewards", source)
    advantages = [ADVANTAGES[agent][episode // 2][episode % 2]
                  for agent, episode in zip(rewards.column("agent").to_pylist(), rewards.column("episode").to_pylist())]
    column = rewards.schema.get_field_index("advantage")
    store.commit("rewards", key, rewards.set_column(column, "advantage", pa.array(advantages, pa.float32())))
    return store, key


def test_each_agent_drops_its_own_zero_advantage_groups(store_and_key) -> None:
    store, key = store_and_key
    for agent, informative_group in (("solver", 1), ("verifier", 0)):
        everything = train_batch_for(store, key, agent)
        assert len(everything.advantages) == 4 and everything.dropped_rows == 0
        kept = train_batch_for(store, key, agent, drop_zero_advantage_groups=True)
        assert kept.dropped_rows == 2
        assert kept.advantages == ADVANTAGES[agent][informative_group]
        rollouts = store.read("rollouts", key, agent=agent).sort_by("sample_id")
        expected = rollouts.filter(pc.equal(rollouts.column("group_id"), f"0-0-{informative_group}"))
        assert kept.prompt_ids == expected.column("prompt_ids").to_pylist()
        assert kept.response_ids == expected.column("response_ids").to_pylist()


def test_the_dropped_rows_are_stored_and_summarised_per_agent(store_and_key) -> None:
    store, key = store_and_key
    stats = {"rows": 2, "tokens": 6, "loss_sum": 0.5, "policy_version": 0, "clip_fraction": 0.0, "mean_ratio": 1.0}
    store.commit("policy_updates", key, updates_table({"solver": {**stats, "dropped_rows": 2},
                                                       "verifier": {**stats, "dropped_rows": 0}}))
    summary = stage_summary("policy_updates", store.read("policy_updates", key))
    assert (summary["dropped_rows/solver"], summary["dropped_rows/verifier"]) == (2, 0)
    older = MicroBatchKey("r", 1, 0)  # stats without the figure (a trainer from before dynamic sampling)
    store.commit("policy_updates", older, updates_table({"solver": stats}))
    assert not any(name.startswith("dropped_rows") for name in stage_summary("policy_updates",
                                                                              store.read("policy_updates", older)))


def test_dropping_renormalises_the_gradient_by_the_informative_tokens(tiny_model_dir: Path) -> None:
    # Two groups: the first all-zero advantages (3 + 2 response tokens), the second informative (1 + 4 tokens).
    prompts = [[5, 6, 7], [9, 4], [8, 8], [3, 2, 1]]
    responses = [[8, 9, 10], [3, 3], [7], [4, 5, 6, 7]]
    old = [[-1.0] * len(r) for r in responses]
    everything = TrainBatch(prompts, responses, old, [0.0, 0.0, 1.0, -1.0])
    informative = TrainBatch(prompts[2:], responses[2:], old[2:], [1.0, -1.0], dropped_rows=2)
    norms, tokens = [], []
    for batch in (everything, informative):
        trainer = PolicyTrainer(str(tiny_model_dir), 0, lr=1e-3, weight_decay=0.0, max_grad_norm=1e9, clip_eps=0.2,
                                seed=0, num_threads=1)
        assert trainer.accumulate(batch)["dropped_rows"] == batch.dropped_rows
        result = trainer.apply_step()
        norms.append(result.grad_norm)
        tokens.append(result.tokens)
    # Zero-advantage rows add nothing to the summed gradient, only to the token count it is divided by.
    assert tokens == [10, 5]
    assert norms[1] / norms[0] == pytest.approx(10 / 5, rel=1e-4)
