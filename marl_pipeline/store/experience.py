"""The experience store: per-stage Arrow datasets, hive-partitioned run / stage / step / micro_batch / agent.

Layout under the store root (a local directory or ``s3://bucket/prefix``; docs/store.md)::

    run=R/stage=S/step=I/micro_batch=K/_manifest.json                   the committed attempt and its files
    run=R/stage=S/step=I/micro_batch=K/agent=A/part-<attempt>.parquet   committed stage outputs
    run=R/stage=S/step=I/_staging-micro_batch=K-<attempt>/...            a local commit in progress (invisible)
    run=R/policies/agent=A/version=V/                                    policy checkpoints (HF format)
    run=R/launch.json                                                    the launch record (run/launches.py)

A micro-batch's stage output becomes visible all at once through its manifest (marl_pipeline.store.commits).
Readers resolve manifests and open exactly the files they name, with column projection, so reading one
agent of one micro-batch opens one file. Policy checkpoints live in the store (the bucket for S3) and are
read from a local directory, a copy in ``StoreConfig.policy_cache`` for S3 (marl_pipeline.store.checkpoints).
"""

from __future__ import annotations

import os
import random
import re
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from marl_pipeline.config import RetentionConfig, StoreConfig
from marl_pipeline.store import commits
from marl_pipeline.store.checkpoints import CheckpointError, PolicyCheckpoints, PolicyUpload
from marl_pipeline.store.commits import Manifest
from marl_pipeline.store.schema import (
    DATASET_SCHEMAS,
    NON_NULL_COLUMNS,
    OPTIONAL_COLUMNS,
    PARTITION_SCHEMA,
    READABLE_SCHEMA_VERSIONS,
    SCHEMA_VERSION,
    columns_to_read,
    upgraded,
    with_version,
)
from marl_pipeline.store.storage import open_location, policy_root, read_json, write_json

_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")
_READ_ATTEMPTS = 10
"""A read retries when a re-commit replaced the files it was reading (it then reads the new commit)."""


def _read_attempts() -> Iterator[int]:
    """Attempt numbers of a read that re-commits may race. A jittered pause between attempts (growing to 50 ms)
    lets a writer's swap finish: 5 immediate retries lost to back-to-back S3 re-commits (1 CI run in ~20)."""
    for attempt in range(_READ_ATTEMPTS):
        if attempt:
            time.sleep(random.uniform(0, min(0.05, 0.005 * 2 ** attempt)))
        yield attempt


class StoreError(RuntimeError):
    """A stored partition is missing, unreadable or of an unsupported schema version, or input is invalid."""


@dataclass(frozen=True, order=True)
class MicroBatchKey:
    """Names one micro-batch of one step of one run."""

    run: str
    step: int
    micro_batch: int

    def __str__(self) -> str:
        return f"{self.run}/step={self.step}/micro_batch={self.micro_batch}"


class ExperienceStore:
    """Reads and atomically commits stage partitions and policy checkpoints under one root.

    Args:
        uri: a local directory, ``s3://bucket/prefix``, or a ``StoreConfig`` (endpoint, keys, policy cache).
    """

    def __init__(self, uri: str | os.PathLike | StoreConfig) -> None:
        try:
            self.config = uri if isinstance(uri, StoreConfig) else StoreConfig(uri=str(uri))
            self.location = open_location(self.config)
        except ValueError as error:
            raise StoreError(str(error)) from None
        self.uri = self.location.uri
        self.root = policy_root(self.config, self.location)
        """Local directory: the store itself, or this node's policy cache of an S3 store."""
        self.checkpoints = PolicyCheckpoints(self.location, self.root)
        self.models = PolicyCheckpoints(self.location, self.root, folder="models", key="name")
        """The run's built-in model and reward model, committed as policies are (version 0 of each name)."""
        self._format = ds.ParquetFileFormat()

    def __repr__(self) -> str:
        return f"ExperienceStore({self.uri!r})"

    # -- paths ------------------------------------------------------------------------------------
    def stage_path(self, run: str, stage: str) -> str:
        if stage not in DATASET_SCHEMAS:
            raise StoreError(f"unknown stage {stage!r}; stages are {list(DATASET_SCHEMAS)}")
        _check_name("run", run)
        return self.location.path(f"run={run}", f"stage={stage}")

    def partition_path(self, stage: str, key: MicroBatchKey) -> str:
        if key.step < 0 or key.micro_batch < 0:
            raise StoreError(f"{stage} {key}: step and micro_batch must be >= 0")
        return f"{self.stage_path(key.run, stage)}/step={key.step}/micro_batch={key.micro_batch}"

    # -- commits ----------------------------------------------------------------------------------
    def commit(self, stage: str, key: MicroBatchKey, table: pa.Table) -> Path | str:
        """Write one micro-batch's stage output (all agents) and make it visible at once: ``table`` has the stage's
        columns plus an ``agent`` column; rows are split by agent. A partition already committed is replaced whole.
        Returns the partition's directory (a URI on S3)."""
        return self.commit_validated(stage, key, *self.validated(stage, key, table))

    def commit_validated(self, stage: str, key: MicroBatchKey, body: pa.Table, agents: pa.ChunkedArray) -> Path | str:
        """:meth:`commit` of what :meth:`validated` made of a table."""
        target = self.partition_path(stage, key)
        attempt = commits.new_attempt()
        local = self.location.local
        directory = f"{target.rsplit('/', 1)[0]}/_staging-micro_batch={key.micro_batch}-{attempt}" if local else target
        files, rows = {}, {}
        try:
            for agent, part in split_by_agent(body, agents):
                files[agent] = f"agent={agent}/part-{attempt}.parquet"
                rows[agent] = part.num_rows
                if local:
                    os.makedirs(f"{directory}/agent={agent}", exist_ok=True)
                pq.write_table(part, f"{directory}/{files[agent]}", filesystem=self.location.arrow,
                               compression=self.config.compression)
            manifest = Manifest(attempt, SCHEMA_VERSION, files, rows)
            if local:
                os.makedirs(directory, exist_ok=True)  # an empty micro-batch is still a commit
                commits.write_manifest(self.location, directory, manifest)
                commits.swap_in(Path(directory), Path(target))
                replaced = None
            else:
                replaced = commits.read_manifest(self.location, target)
                commits.write_manifest(self.location, target, manifest)  # the commit point
        except BaseException:
            self._discard(directory, files, attempt)
            raise
        stale = [f"{target}/{f}" for f in (replaced.files.values() if replaced else ()) if f not in files.values()]
        commits.remove(self.location, stale + commits.partition_garbage(self.location, target, manifest,
                                                                        commits.GRACE_SECONDS))
        return Path(target) if local else self.location.uri_of(target)

    def validated(self, stage: str, key: MicroBatchKey, table: pa.Table) -> tuple[pa.Table, pa.ChunkedArray]:
        """The table as a commit stores it (the stage's schema and types) and its agent column; bad input raises."""
        self.partition_path(stage, key)  # an unknown stage, a bad run name or key: the error names it first
        schema, what = DATASET_SCHEMAS[stage], f"{stage} {key}"
        if "agent" not in table.column_names:
            raise StoreError(f"{what}: the table to commit has no 'agent' column")
        missing = [name for name in schema.names if name not in table.column_names and name not in OPTIONAL_COLUMNS]
        if missing:
            raise StoreError(f"{what}: the table to commit lacks columns {missing}")
        agents = table.column("agent")
        if agents.null_count:
            raise StoreError(f"{what}: the 'agent' column has {agents.null_count} null values")
        for agent in pc.unique(agents).to_pylist():
            _check_name("agent", agent)
        columns = []
        for field in schema:
            if field.name not in table.column_names:
                columns.append(pa.nulls(table.num_rows, field.type))
                continue
            column = table.column(field.name)
            if field.name in NON_NULL_COLUMNS and column.null_count:
                raise StoreError(f"{what}: the {field.name!r} column has {column.null_count} null values")
            try:
                columns.append(column if column.type == field.type else column.cast(field.type))
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as error:
                raise StoreError(f"{what}: column {field.name!r} has type {column.type}, the {stage} schema "
                                 f"wants {field.type}: {error}") from None
        return pa.Table.from_arrays(columns, schema=with_version(schema)), agents

    def _discard(self, directory: str, files: dict[str, str], attempt: str) -> None:
        # A failed commit removes what it wrote; a killed one leaves it to the garbage collection.
        if self.location.local:
            commits.remove(self.location, [directory])
        else:
            commits.remove(self.location, [f"{directory}/{f}" for f in files.values()
                                           if self.location.fs.exists(f"{directory}/{f}")])

    def vacuum(self, older_than: float = commits.GRACE_SECONDS, run: str = "*") -> list[str]:
        """Delete leftovers of dead writers older than ``older_than`` seconds (of ``run``, or of every run); returns
        the deleted paths."""
        return (commits.collect_garbage(self.location, older_than, run) + self.checkpoints.garbage(older_than, run)
                + self.models.garbage(older_than, run))

    # -- reads ------------------------------------------------------------------------------------
    def manifest(self, stage: str, key: MicroBatchKey) -> Manifest | None:
        """The committed attempt of a partition; None when it is not committed."""
        path = self.partition_path(stage, key)
        try:
            manifest = commits.read_manifest(self.location, path)
        except ValueError as error:
            raise StoreError(f"{stage} {key}: {error}") from None
        return self._readable(manifest, f"{stage} {key} ({self.location.uri_of(path)})")

    def _readable(self, manifest: Manifest | None, what: str) -> Manifest | None:
        if manifest is not None and manifest.schema_version not in READABLE_SCHEMA_VERSIONS:
            raise StoreError(f"{what} has schema version {manifest.schema_version}; this marl_pipeline reads "
                             f"versions {READABLE_SCHEMA_VERSIONS} (a newer marl_pipeline wrote it: upgrade)")
        return manifest

    def is_committed(self, stage: str, key: MicroBatchKey) -> bool:
        return self.manifest(stage, key) is not None

    def committed_keys(self, run: str, stage: str) -> list[MicroBatchKey]:
        """Every committed micro-batch of a stage, in order."""
        stage_path = self.stage_path(run, stage)
        pattern = "step=*/micro_batch=*" if self.location.local else f"step=*/micro_batch=*/{commits.MANIFEST}"
        keys = []
        for path in self.location.fs.glob(f"{stage_path}/{pattern}"):
            step, micro_batch = path[len(stage_path) + 1:].split("/")[:2]
            keys.append(MicroBatchKey(run, int(step[5:]), int(micro_batch[12:])))
        return sorted(keys)

    def runs(self) -> list[str]:
        try:
            entries = self.location.fs.ls(self.location.base, detail=False)
        except FileNotFoundError:
            return []
        return sorted(name[4:] for name in (e.rstrip("/").rsplit("/", 1)[-1] for e in entries)
                      if name.startswith("run="))

    def read(self, stage: str, key: MicroBatchKey, agent: str | None = None,
             columns: list[str] | None = None) -> pa.Table:
        """Read one committed micro-batch of a stage, with an ``agent`` column.

        With ``agent``, only that agent's file is opened. Columns that rows of an older schema version lack are
        null, or derived from the columns they have (``schema.DERIVED_COLUMNS``: ``group_id``).
        """
        partition = self.partition_path(stage, key)
        for _ in _read_attempts():
            manifest = self.manifest(stage, key)
            if manifest is None:
                raise StoreError(f"{stage} {key} is not committed (no {self.location.uri_of(partition)})")
            files = {a: f for a, f in manifest.files.items() if agent is None or a == agent}
            paths = [f"{partition}/{f}" for f in files.values()]
            try:
                table = self._dataset(stage, paths, partition, ("agent",), columns).to_table(
                    columns=columns_to_read(columns))
                return upgraded(table, columns)
            except (OSError, pa.ArrowInvalid) as error:
                if self.manifest(stage, key) == manifest:
                    raise self._unreadable(f"{stage} {key}", stage, paths, partition, ("agent",), error) from None
        raise StoreError(f"{stage} {key}: re-committed {_READ_ATTEMPTS} times while being read")

    def dataset(self, run: str, stage: str) -> ds.Dataset:
        """The committed partitions of a stage as one pyarrow dataset (step, micro_batch and agent columns).

        Filters on step, micro_batch or agent prune files; DuckDB and Polars query it directly (docs/store.md).
        """
        for _ in _read_attempts():
            try:
                return self._committed_dataset(run, stage)
            except FileNotFoundError:
                continue  # a re-commit deleted files between reading their manifest and opening them: resolve again
        raise StoreError(f"{stage} of run {run}: re-committed {_READ_ATTEMPTS} times while being opened")

    def _committed_dataset(self, run: str, stage: str) -> ds.Dataset:
        stage_path = self.stage_path(run, stage)
        partitions = [self.partition_path(stage, key) for key in self.committed_keys(run, stage)]
        # One batched read of every manifest (concurrent requests on S3) rather than one round trip each.
        blobs = self.location.fs.cat([f"{p}/{commits.MANIFEST}" for p in partitions], on_error="omit") \
            if partitions else {}
        paths = []
        for partition in partitions:
            where = self.location.uri_of(partition)
            blob = blobs.get(f"{partition}/{commits.MANIFEST}")
            try:
                manifest = (Manifest.from_bytes(blob, where) if blob is not None
                            else commits.read_manifest(self.location, partition))  # a version-1 local partition
            except ValueError as error:
                raise StoreError(f"{stage} of run {run}: {error}") from None
            if self._readable(manifest, f"{stage} {where}") is not None:
                paths += [f"{partition}/{name}" for name in manifest.files.values()]
        return self._dataset(stage, paths, stage_path, ("step", "micro_batch", "agent"), None)

    def read_stage(self, run: str, stage: str, columns: list[str] | None = None,
                   filter: ds.Expression | None = None) -> pa.Table:
        """Read every committed partition of a stage for a run, with step, micro_batch and agent columns.

        Rows of older schema versions are upgraded as by :meth:`read`; ``filter`` sees the stored values (a
        ``group_id`` of a row written before schema 5 is null there).
        """
        levels = ("step", "micro_batch", "agent")
        for _ in _read_attempts():
            dataset = self.dataset(run, stage)
            try:
                return upgraded(dataset.to_table(columns=columns_to_read(columns), filter=filter), columns)
            except (OSError, pa.ArrowInvalid) as error:
                if self.dataset(run, stage).files == dataset.files:
                    raise self._unreadable(f"{stage} of run {run}", stage, dataset.files, self.stage_path(run, stage),
                                           levels, error) from None
        raise StoreError(f"{stage} of run {run}: re-committed {_READ_ATTEMPTS} times while being read")

    def _dataset(self, stage: str, paths: list[str], base: str, levels: tuple[str, ...],
                 columns: list[str] | None) -> ds.Dataset:
        # The current schema is given, not inferred: files of older readable versions lack new columns,
        # which come back null; and no file is opened just to learn the schema.
        level_fields = [PARTITION_SCHEMA.field(name) for name in levels]
        schema = pa.schema(list(DATASET_SCHEMAS[stage]) + level_fields)
        if columns is not None and (unknown := [c for c in columns if c not in schema.names]):
            raise StoreError(f"{stage}: unknown columns {unknown}; columns are {schema.names}")
        return ds.dataset(paths, schema=schema, format=self._format, filesystem=self.location.arrow,
                          partitioning=ds.partitioning(pa.schema(level_fields), flavor="hive"),
                          partition_base_dir=base)

    def _unreadable(self, what: str, stage: str, paths: list[str], base: str, levels: tuple[str, ...],
                    error: Exception) -> StoreError:
        """Name the file (and its partition) that fails, by reading the files one at a time."""
        for path in paths:
            try:
                self._dataset(stage, [path], base, levels, None).to_table()
            except (OSError, pa.ArrowInvalid) as file_error:
                partition = path[len(self.location.base) + 1:].rsplit("/", 1)[0]
                return StoreError(f"{what}: unreadable file {self.location.uri_of(path)} "
                                  f"(partition {partition}): {file_error}")
        return StoreError(f"{what}: unreadable data: {error}")

    # -- policies (store/checkpoints.py) -----------------------------------------------------------
    def policy_dir(self, run: str, agent: str, version: int) -> Path:
        """Where ``version`` is on this node (local store) or cached (S3); it may not exist: see
        :meth:`require_policy`."""
        return self.checkpoints.local_dir(run, agent, version)

    def policy_versions(self, run: str, agent: str) -> list[int]:
        """The committed versions of ``agent`` (in the bucket for an S3 store)."""
        return self.checkpoints.versions(run, agent)

    def staging_policy_dir(self, run: str, agent: str, version: int) -> Path:
        """A fresh local directory to save a policy into before :meth:`commit_policy` (or ``upload_policy``)."""
        return self.checkpoints.staging(run, agent, version)

    def commit_policy(self, staging: Path, run: str, agent: str, version: int) -> Path | str:
        """Upload and publish a version saved by this process; returns its directory (a URI on S3)."""
        return self.checkpoints.commit(staging, run, agent, version)

    def upload_policy(self, staging: Path, run: str, agent: str, version: int) -> PolicyUpload:
        """Ship a saved version to the store, not yet visible (a trainer, on its own node)."""
        return self.checkpoints.upload(staging, run, agent, version)

    def publish_policy(self, upload: PolicyUpload, extra: dict[str, bytes] | None = None) -> Path | str:
        """Make an uploaded version visible, with ``extra`` files added (the driver, after the engine loaded it)."""
        return self.checkpoints.publish(upload, extra)

    def policy_file(self, run: str, agent: str, version: int, name: str) -> bytes | None:
        """One file of a committed version, without fetching the checkpoint; None when absent."""
        return self.checkpoints.read_file(run, agent, version, name)

    def prune_policies(self, run: str, agent: str, retention: RetentionConfig, protected: Iterable[int] = ()
                       ) -> list[int]:
        """Delete ``agent``'s policy versions that ``retention`` does not keep (``store/retention.py``)."""
        return self.checkpoints.prune(run, agent, retention, protected)

    def require_policy(self, run: str, agent: str, version: int) -> Path:
        """A local directory holding a stored policy version (downloaded into this node's cache from an S3 store);
        a clear error when it was never committed or was pruned."""
        try:
            return self.checkpoints.fetch(run, agent, version)
        except CheckpointError as error:
            raise StoreError(str(error)) from None

    # -- run records ------------------------------------------------------------------------------
    def read_record(self, run: str, name: str) -> dict | None:
        """A small JSON record of a run (``launch.json``), in the store (the bucket for S3); None when absent."""
        _check_name("run", run)
        return read_json(self.location, self.location.path(f"run={run}", name))

    def write_record(self, run: str, name: str, record: dict) -> None:
        """Replace a run's record at once (a rename locally, one PUT on S3): a writer killed midway leaves the old
        record whole."""
        _check_name("run", run)
        write_json(self.location, self.location.path(f"run={run}", name), record)


def _check_name(kind: str, value: object) -> None:
    if not isinstance(value, str) or not _NAME.match(value):
        raise StoreError(f"invalid {kind} name {value!r}: use letters, digits, '_', '.' and '-' (it names a directory)")


def split_by_agent(table: pa.Table, agents: pa.ChunkedArray):
    """(agent, rows) per agent, agents sorted; a contiguous run of rows is sliced (no copy), not filtered."""
    for agent in sorted(pc.unique(agents).to_pylist()):
        positions = pc.indices_nonzero(pc.equal(agents, agent))
        first, count = positions[0].as_py(), len(positions)
        if positions[count - 1].as_py() - first + 1 == count:
            yield agent, table.slice(first, count)
        else:
            yield agent, table.take(positions)
