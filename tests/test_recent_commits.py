"""Reads of partitions this process just committed, answered from memory (store/recent.py), equal the store's."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest

from marl_pipeline.store import ExperienceStore, MicroBatchKey
from marl_pipeline.store.recent import RecentCommits
from tests.test_store import _rewards


@pytest.mark.parametrize("agent", [None, "solver", "verifier"])
@pytest.mark.parametrize("columns", [None, ["sample_id", "reward"], ["agent", "advantage"], ["model_score"]])
def test_a_recent_read_is_the_stores(tmp_path: Path, agent: str | None, columns: list[str] | None) -> None:
    store = ExperienceStore(str(tmp_path / "store"))
    recent = RecentCommits(store, capacity=4)
    key = MicroBatchKey("r", 0, 0)
    # Agents interleaved (as large strings), rewards as float64 (the schema's float32) and model_score missing: the
    # stored table is cast, padded and grouped by agent, and the one held must be too.
    table = _rewards(["verifier", "solver"], 0.25, per_agent=3)
    table = table.set_column(table.column_names.index("agent"), "agent", table.column("agent").cast(pa.large_string()))
    assert "model_score" not in table.column_names and table.schema.field("reward").type == pa.float64()
    recent.commit("rewards", key, table)
    held, stored = recent.read("rewards", key, agent=agent, columns=columns), store.read("rewards", key, agent, columns)
    assert held.schema.equals(stored.schema) and held.equals(stored)
    assert held.num_rows == (6 if agent is None else 3)


def test_older_commits_are_read_from_the_store_and_a_recommit_replaces(tmp_path: Path, monkeypatch) -> None:
    store = ExperienceStore(str(tmp_path / "store"))
    recent = RecentCommits(store, capacity=2)
    keys = [MicroBatchKey("r", step, 0) for step in range(3)]
    for step, key in enumerate(keys):
        recent.commit("rewards", key, _rewards(["solver"], float(step)))
    recent.commit("rewards", keys[2], _rewards(["solver"], 7.0))  # a re-commit: the new rows, in memory and stored
    reads = []
    monkeypatch.setattr(store, "read", lambda *args, **kwargs: reads.append(args[1]) or ExperienceStore.read(
        store, *args, **kwargs))
    assert [set(recent.read("rewards", key).column("reward").to_pylist()) for key in keys] == [{0.0}, {1.0}, {7.0}]
    assert reads == [keys[0]]  # only the oldest, pushed out of memory, was read from the store
