"""A plugin written from docs/environments.md alone runs end to end through the Dagster `train` job."""

from __future__ import annotations

from pathlib import Path

import dagster as dg
import yaml

from assets.definitions import defs
from marl_pipeline.environment import register_environment
from marl_pipeline.store import ExperienceStore
from tests.docs_plugin import RelayGame


def test_docs_plugin_trains_through_the_train_job(tmp_path: Path) -> None:
    register_environment(RelayGame)
    data = {
        "run": "relay", "store": str(tmp_path / "store"),
        "environment": {"name": "docs_relay", "options": {"colours": 3}},
        "agents": {role: {"warmup": {"steps": 30}} for role in ("sender", "receiver")},
        "pipeline": {"steps": 2, "prompts_per_micro_batch": 4, "samples_per_prompt": 4, "micro_batches_per_step": 2},
    }
    config_path = tmp_path / "relay.yaml"
    config_path.write_text(yaml.safe_dump(data))
    (tmp_path / "home").mkdir()
    with dg.DagsterInstance.local_temp(str(tmp_path / "home")) as instance:
        result = defs.get_job_def("train").execute_in_process(
            instance=instance, run_config={"resources": {"experiment": {"config": {"config_path": str(config_path)}}}})
        assert result.success
        partitions = {r.asset_materialization.partition
                      for r in instance.fetch_materializations(dg.AssetKey("rewards"), limit=100).records}
        assert len(partitions) == 4
    store = ExperienceStore(data["store"])
    rewards = store.read_stage("relay", "rewards", columns=["agent", "reward", "sample_id"])
    assert sorted(set(rewards.column("agent").to_pylist())) == ["receiver", "sender"]
    # team reward: both agents of an episode get the same reward
    by_episode: dict[tuple[str, str], set] = {}
    for row in rewards.to_pylist():
        input_id, _turn, trajectory = row["sample_id"].split("_")
        by_episode.setdefault((input_id, trajectory), set()).add(row["reward"])
    assert len(by_episode) == 2 * 2 * 4 * 4 and all(len(values) == 1 for values in by_episode.values())
    results = store.read_stage("relay", "environment_results", columns=["outcome"]).column("outcome").to_pylist()
    assert set(results) <= {"sent", "match", "miss"}
    assert store.policy_versions("relay", "sender") == [0, 1, 2]
