"""Experience store on a local directory: atomic commits, replacement, pruning by agent, clear errors."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.dataset as ds
import pytest

from marl_pipeline.schema import REWARDS, SCHEMA_VERSION
from marl_pipeline.store import ExperienceStore, MicroBatchKey, StoreError


def _rewards(agents: list[str], value: float) -> pa.Table:
    rows = []
    for index, agent in enumerate(agents * 2):
        rows.append({"sample_id": f"0-0-{index}_0_0", "episode": index, "task_id": "1+1", "trajectory": 0,
                     "role": agent, "turn": 0, "reward": value, "advantage": 0.0, "status": "ok", "error": None,
                     "agent": agent})
    return pa.Table.from_pylist(rows)


def test_commit_read_and_replace(tmp_path: Path) -> None:
    store = ExperienceStore(tmp_path)
    key = MicroBatchKey("r", 3, 1)
    store.commit("rewards", key, _rewards(["solver", "verifier"], 1.0))
    table = store.read("rewards", key)
    assert table.num_rows == 4
    assert sorted(set(table.column("agent").to_pylist())) == ["solver", "verifier"]
    store.commit("rewards", key, _rewards(["solver"], 0.5))  # a re-run replaces, never mixes
    table = store.read("rewards", key)
    assert table.num_rows == 2 and set(table.column("reward").to_pylist()) == {0.5}
    assert store.committed_keys("r", "rewards") == [key]
    leftovers = [p.name for p in (tmp_path / "run=r" / "stage=rewards" / "step=3").iterdir()]
    assert leftovers == ["micro_batch=1"]


def test_dataset_is_hive_partitioned_and_versioned(tmp_path: Path) -> None:
    store = ExperienceStore(tmp_path)
    for step in range(2):
        store.commit("rewards", MicroBatchKey("r", step, 0), _rewards(["solver", "verifier"], float(step)))
    dataset = ds.dataset(tmp_path, format="parquet", partitioning="hive")
    table = dataset.to_table(filter=(ds.field("stage") == "rewards") & (ds.field("step") == 1))
    assert table.num_rows == 4 and set(table.column("reward").to_pylist()) == {1.0}
    metadata = dataset.schema.metadata or next(iter(dataset.get_fragments())).physical_schema.metadata
    assert metadata[b"marl_pipeline.schema_version"] == str(SCHEMA_VERSION).encode()
    assert store.read_stage("r", "rewards").num_rows == 8


def test_reading_one_agent_opens_only_its_files(tmp_path: Path) -> None:
    store = ExperienceStore(tmp_path)
    key = MicroBatchKey("r", 0, 0)
    path = store.commit("rewards", key, _rewards(["solver", "verifier"], 1.0))
    # Corrupt the other agent's file: a read of `solver` must not touch it.
    (path / "agent=verifier" / "part-0.parquet").write_bytes(b"not parquet")
    table = store.read("rewards", key, agent="solver")
    assert set(table.column("agent").to_pylist()) == {"solver"}
    with pytest.raises(StoreError, match="agent=verifier"):
        store.read("rewards", key)


def test_uncommitted_partition_and_unknown_stage_fail_clearly(tmp_path: Path) -> None:
    store = ExperienceStore(tmp_path)
    with pytest.raises(StoreError, match="not committed"):
        store.read("rewards", MicroBatchKey("r", 0, 0))
    with pytest.raises(StoreError, match="unknown stage"):
        store.commit("scores", MicroBatchKey("r", 0, 0), _rewards(["solver"], 1.0))
    with pytest.raises(StoreError, match="lacks columns"):
        store.commit("rewards", MicroBatchKey("r", 0, 0), _rewards(["solver"], 1.0).drop_columns(["reward"]))
    assert not (tmp_path / "run=r" / "stage=rewards" / "step=0" / "micro_batch=0").exists()


def test_schema_has_the_documented_column_groups() -> None:
    for name in ("sample_id", "role", "turn", "reward", "advantage", "status", "error"):
        assert name in REWARDS.names
