"""Reads of what this process just committed, answered from memory (the orchestrator's stages).

The next stages read each micro-batch's partitions back right after the orchestrator commits them (environment:
the rollouts; reward: those and the environment results; train: each agent's rollouts and rewards), each read a
pyarrow dataset over local disk or S3 (BENCHMARKS.md, issue 28.2). :class:`RecentCommits` commits through the store
and keeps the table as stored, so such a read is a filter and a projection in memory and returns what the store's
would; a partition it no longer holds (a resumed launch's, one pushed out by newer ones) is read from the store.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from marl_pipeline.store.experience import ExperienceStore, MicroBatchKey, split_by_agent
from marl_pipeline.store.schema import PARTITION_SCHEMA, upgraded


class RecentCommits:
    """Commits through ``store`` and answers reads of its last ``capacity`` commits from memory.

    ``capacity``: partitions held, oldest dropped first; a pipeline needs those of the micro-batches between
    rollout and training (its staleness plus the step in flight)."""

    def __init__(self, store: ExperienceStore, capacity: int) -> None:
        self.store = store
        self.capacity = capacity
        self._tables: OrderedDict[tuple[str, MicroBatchKey], pa.Table] = OrderedDict()
        self._lock = threading.Lock()  # stage threads commit and read at once

    def commit(self, stage: str, key: MicroBatchKey, table: pa.Table) -> Path | str:
        """``ExperienceStore.commit``, keeping the table as stored: the stage's schema, rows grouped by agent in
        the order of the partition's files."""
        body, agents = self.store.validated(stage, key, table)
        path = self.store.commit_validated(stage, key, body, agents)
        agent_type = PARTITION_SCHEMA.field("agent").type  # the type a read gives the partition column
        agents = agents.cast(agent_type)
        body = body.append_column(pa.field("agent", agent_type), agents)
        stored = pa.concat_tables([part for _, part in split_by_agent(body, agents)]) if body.num_rows else body
        with self._lock:
            self._tables[(stage, key)] = stored
            self._tables.move_to_end((stage, key))
            while len(self._tables) > self.capacity:
                self._tables.popitem(last=False)
        return path

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
