"""Reads of partitions this process just committed, answered from memory (store/recent.py), equal the store's."""

from __future__ import annotations

import threading
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


def test_commits_written_behind_land_in_order_and_reads_never_wait_for_them(tmp_path: Path, monkeypatch) -> None:
    """With ``behind``, a commit returns before its write: the next stage reads it from memory, even past the
    capacity while its write is pending; writes land in the order the commits were made, each ``written`` callback
    once durable, and flush waits for all of them. The slow disk is a fake (an event holds the writer): the real one
    cannot be made slow on demand."""
    store = ExperienceStore(str(tmp_path / "store"))
    recent = RecentCommits(store, capacity=1, behind=True)
    release, order = threading.Event(), []
    real = store.commit_validated

    def slow(stage, key, *args):
        release.wait(timeout=30)
        return real(stage, key, *args)

    monkeypatch.setattr(store, "commit_validated", slow)
    keys = [MicroBatchKey("r", step, 0) for step in range(3)]
    for step, key in enumerate(keys):
        recent.commit("rewards", key, _rewards(["solver"], float(step)),
                      lambda path, handed, key=key: order.append((key, store.is_committed("rewards", key))))
    assert not any(store.is_committed("rewards", key) for key in keys)  # none written yet, all readable
    assert [recent.read("rewards", key).column("reward").to_pylist()[0] for key in keys] == [0.0, 1.0, 2.0]
    release.set()
    recent.flush()
    assert order == [(key, True) for key in keys]
    assert [store.read("rewards", key).column("reward").to_pylist()[0] for key in keys] == [0.0, 1.0, 2.0]
    recent.close()


def test_a_failed_write_stops_every_later_one_and_is_raised_to_the_next_commit(tmp_path: Path, monkeypatch) -> None:
    """What a killed launch leaves durable must be a prefix of its commits: after a write fails (a fake failure: a
    full disk cannot be made on demand), nothing later is written, and the next commit and flush raise the error."""
    store = ExperienceStore(str(tmp_path / "store"))
    recent = RecentCommits(store, capacity=8, behind=True)
    real = store.commit_validated
    keys = [MicroBatchKey("r", step, 0) for step in range(3)]

    def failing(stage, key, *args):
        if key == keys[1]:
            raise OSError("No space left on device")
        return real(stage, key, *args)

    monkeypatch.setattr(store, "commit_validated", failing)
    for step, key in enumerate(keys):
        try:
            recent.commit("rewards", key, _rewards(["solver"], float(step)))
        except OSError:  # the writer failed key 1 before this commit was asked for (a loaded host): raised at once
            assert step == 2
    with pytest.raises(OSError, match="No space left"):
        recent.flush()
    assert [store.is_committed("rewards", key) for key in keys] == [True, False, False]
    with pytest.raises(OSError, match="No space left"):
        recent.commit("rewards", MicroBatchKey("r", 3, 0), _rewards(["solver"], 3.0))
    recent.close()
