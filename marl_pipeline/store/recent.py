"""Reads of what this process just committed, answered from memory (the orchestrator's stages).

The next stages read each micro-batch's partitions back right after the orchestrator commits them (environment:
the rollouts; reward: those and the environment results; train: each agent's rollouts and rewards), each read a
pyarrow dataset over local disk or S3, on the stages' path. :class:`RecentCommits` commits through the store
and keeps the table as stored, so such a read is a filter and a projection in memory and returns what the store's
would; a partition it no longer holds (a resumed launch's, one pushed out by newer ones) is read from the store.

With ``behind``, a commit is validated in the caller's thread and written by one writer thread, in the order the
commits were made, while the caller goes on (the next stage reads the table from memory): what a killed launch
leaves durable is a prefix of its commits, as it was when each commit was written before the next stage began.
Whatever must follow earlier commits on disk (a policy version, a read of the store itself) calls :meth:`flush`
first.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from marl_pipeline.store.experience import ExperienceStore, MicroBatchKey, split_by_agent
from marl_pipeline.store.schema import PARTITION_SCHEMA, upgraded


class RecentCommits:
    """Commits through ``store`` and answers reads of its last ``capacity`` commits from memory.

    ``capacity``: partitions held, oldest dropped first (never one whose write is pending); a pipeline needs those of
    the micro-batches between rollout and training (its staleness plus the step in flight). ``behind``: writes on a
    thread of their own (above)."""

    def __init__(self, store: ExperienceStore, capacity: int, *, behind: bool = False) -> None:
        self.store = store
        self.capacity = capacity
        self._tables: OrderedDict[tuple[str, MicroBatchKey], pa.Table] = OrderedDict()
        self._lock = threading.Condition()  # stage threads commit and read at once; flush waits on the writer
        self._pending: dict[tuple[str, MicroBatchKey], int] = {}  # writes not yet done, per partition
        self._made = self._written = 0  # commits made, and written (in that order)
        self._failure: BaseException | None = None
        self._writes: queue.SimpleQueue | None = None
        if behind:
            self._writes = queue.SimpleQueue()
            self._writer = threading.Thread(target=self._write_loop, name="marl-store-writer", daemon=True)
            self._writer.start()

    def commit(self, stage: str, key: MicroBatchKey, table: pa.Table,
               written: Callable[[Path | str, float], None] | None = None) -> None:
        """``ExperienceStore.commit``, keeping the table as stored (the stage's schema, rows grouped by agent in the
        order of the partition's files). Bad input raises here; ``written(path, handed)`` is called once the
        partition is durable (on the writer's thread, with ``behind``), ``handed`` when the caller was done with the
        commit (epoch seconds)."""
        self._raise_failure()
        body, agents = self.store.validated(stage, key, table)
        agent_type = PARTITION_SCHEMA.field("agent").type  # the type a read gives the partition column
        typed_agents = agents.cast(agent_type)
        typed = body.append_column(pa.field("agent", agent_type), typed_agents)
        stored = pa.concat_tables([part for _, part in split_by_agent(typed, typed_agents)]) if body.num_rows else typed
        if self._writes is None:
            self._write(stage, key, body, agents, written, None)
        with self._lock:
            self._tables[(stage, key)] = stored
            self._tables.move_to_end((stage, key))
            if self._writes is not None:
                self._pending[(stage, key)] = self._pending.get((stage, key), 0) + 1
                self._made += 1
                self._writes.put((stage, key, body, agents, written, time.time()))
            self._evict()

    def flush(self) -> None:
        """Wait until every commit made so far is written; raises the writer's error, if any."""
        with self._lock:
            made = self._made
            self._lock.wait_for(lambda: self._written >= made or self._failure is not None)
        self._raise_failure()

    def close(self) -> None:
        """Stop the writer once its queue is written (a launch's end)."""
        if self._writes is not None and self._writer.is_alive():
            self._writes.put(None)
            self._writer.join()

    def _write(self, stage, key, body, agents, written, handed: float | None) -> None:
        path = self.store.commit_validated(stage, key, body, agents)
        if written is not None:
            written(path, handed or time.time())

    def _write_loop(self) -> None:
        while (item := self._writes.get()) is not None:
            try:
                if self._failure is None:  # after a failure nothing more is written: the prefix stays a prefix
                    self._write(*item)
            except BaseException as error:  # raised by the next commit or flush, in a stage's thread
                self._failure = error
            with self._lock:
                partition = item[:2]
                self._pending[partition] -= 1
                if not self._pending[partition]:
                    del self._pending[partition]
                self._written += 1
                self._evict()
                self._lock.notify_all()

    def _evict(self) -> None:
        """Drop the oldest partitions beyond ``capacity`` whose writes are done (under the lock)."""
        excess = len(self._tables) - self.capacity
        for partition in [p for p in self._tables if p not in self._pending][:max(excess, 0)]:
            del self._tables[partition]

    def _raise_failure(self) -> None:
        if self._failure is not None:
            raise self._failure

    def is_committed(self, stage: str, key: MicroBatchKey) -> bool:
        return self.store.is_committed(stage, key)

    def read(self, stage: str, key: MicroBatchKey, agent: str | None = None,
             columns: list[str] | None = None) -> pa.Table:
        """``ExperienceStore.read``: from memory when this process committed the partition recently."""
        with self._lock:
            table = self._tables.get((stage, key))
        if table is None:
            return self.store.read(stage, key, agent=agent, columns=columns)
        if agent is not None:
            table = table.filter(pc.equal(table.column("agent"), agent))
        return upgraded(table, columns)
