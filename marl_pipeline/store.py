"""The experience store: per-stage Arrow datasets, hive-partitioned run / stage / step / micro_batch / agent.

Layout under the store root::

    run=R/stage=S/step=I/micro_batch=K/agent=A/part-0.parquet      committed stage outputs
    run=R/stage=S/step=I/_staging-micro_batch=K-<uuid>/...          a commit in progress (invisible)
    run=R/policies/agent=A/version=V/                               policy checkpoints (HF format)

A micro-batch's stage output is written whole into a staging directory and then renamed into place,
so readers see all of it or none of it; pyarrow.dataset skips names starting with ``_`` or ``.``.
Re-committing a partition swaps the old directory out before the new one is renamed in (a reader in
that instant sees the partition absent, never mixed), then deletes the old one.
"""

from __future__ import annotations

import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from marl_pipeline.schema import PARTITION_SCHEMA, SCHEMA_VERSION, SCHEMA_VERSION_KEY, STAGE_SCHEMAS, with_version


class StoreError(RuntimeError):
    """A stored partition is missing, unreadable or of an unsupported schema version."""


@dataclass(frozen=True, order=True)
class MicroBatchKey:
    """Names one micro-batch of one step of one run."""

    run: str
    step: int
    micro_batch: int

    def __str__(self) -> str:
        return f"{self.run}/step={self.step}/micro_batch={self.micro_batch}"


class ExperienceStore:
    """Reads and atomically commits stage partitions and policy checkpoints under one root directory."""

    def __init__(self, uri: str | os.PathLike) -> None:
        uri = str(uri)
        if "://" in uri and not uri.startswith("file://"):
            raise StoreError(f"store URI {uri!r}: only local directories are supported by this version")
        self.root = Path(uri.removeprefix("file://")).absolute()

    # -- paths ------------------------------------------------------------------------------------
    def stage_dir(self, run: str, stage: str) -> Path:
        if stage not in STAGE_SCHEMAS:
            raise StoreError(f"unknown stage {stage!r}; stages are {list(STAGE_SCHEMAS)}")
        return self.root / f"run={run}" / f"stage={stage}"

    def partition_dir(self, stage: str, key: MicroBatchKey) -> Path:
        return self.stage_dir(key.run, stage) / f"step={key.step}" / f"micro_batch={key.micro_batch}"

    def policy_dir(self, run: str, agent: str, version: int) -> Path:
        return self.root / f"run={run}" / "policies" / f"agent={agent}" / f"version={version}"

    # -- stage partitions -------------------------------------------------------------------------
    def commit(self, stage: str, key: MicroBatchKey, table: pa.Table) -> Path:
        """Write one micro-batch's stage output (all agents) and make it visible at once.

        ``table`` has the stage's schema plus an ``agent`` column; rows are split by agent.
        Returns the committed partition directory.
        """
        target = self.partition_dir(stage, key)  # also validates the stage name
        schema = STAGE_SCHEMAS[stage]
        if "agent" not in table.column_names:
            raise StoreError(f"{stage} {key}: the table to commit has no 'agent' column")
        missing = [name for name in schema.names if name not in table.column_names]
        if missing:
            raise StoreError(f"{stage} {key}: the table to commit lacks columns {missing}")
        staging = target.parent / f"_staging-{target.name}-{uuid.uuid4().hex}"
        agents = table.column("agent").to_pylist()
        body = table.select(schema.names).cast(schema)
        try:
            for agent in sorted(set(agents)):
                mask = pa.array([a == agent for a in agents])
                agent_dir = staging / f"agent={agent}"
                agent_dir.mkdir(parents=True)
                pq.write_table(body.filter(mask).replace_schema_metadata(with_version(schema).metadata),
                               agent_dir / "part-0.parquet", compression="zstd")
            if not agents:  # an empty micro-batch is still a commit: the directory marks it done
                staging.mkdir(parents=True)
            self._swap_in(staging, target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return target

    def _swap_in(self, staging: Path, target: Path) -> None:
        old = None
        if target.exists():
            old = target.parent / f"_replaced-{target.name}-{uuid.uuid4().hex}"
            os.rename(target, old)
        os.rename(staging, target)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)

    def is_committed(self, stage: str, key: MicroBatchKey) -> bool:
        return self.partition_dir(stage, key).is_dir()

    def read(self, stage: str, key: MicroBatchKey, agent: str | None = None,
             columns: list[str] | None = None) -> pa.Table:
        """Read one committed micro-batch of a stage, with an ``agent`` column.

        With ``agent``, only that agent's files are opened (partition pruning by directory).
        """
        directory = self.partition_dir(stage, key)
        if not directory.is_dir():
            raise StoreError(f"{stage} {key} is not committed (no {directory})")
        what = f"{stage} {key}"
        if agent is None:
            return self._read_dataset(directory, ("agent",), what, columns)
        directory = directory / f"agent={agent}"
        if not directory.is_dir():
            return self._empty(stage, columns).append_column("agent", pa.array([], pa.string()))
        table = self._read_dataset(directory, (), what, columns)
        return table.append_column("agent", pa.array([agent] * table.num_rows, pa.string()))

    def read_stage(self, run: str, stage: str, columns: list[str] | None = None) -> pa.Table:
        """Read every committed partition of a stage for a run, with step, micro_batch and agent columns."""
        directory = self.stage_dir(run, stage)
        if not directory.is_dir():
            return self._empty(stage, columns)
        return self._read_dataset(directory, ("step", "micro_batch", "agent"), f"{stage} of run {run}", columns)

    def committed_keys(self, run: str, stage: str) -> list[MicroBatchKey]:
        """Every committed micro-batch of a stage, in order."""
        keys = []
        for step_dir in self.stage_dir(run, stage).glob("step=*"):
            for mb_dir in step_dir.glob("micro_batch=*"):
                keys.append(MicroBatchKey(run, int(step_dir.name[5:]), int(mb_dir.name[12:])))
        return sorted(keys)

    def runs(self) -> list[str]:
        return sorted(p.name[4:] for p in self.root.glob("run=*") if p.is_dir())

    def _read_dataset(self, directory: Path, levels: tuple[str, ...], what: str,
                      columns: list[str] | None) -> pa.Table:
        """Read the Parquet files under ``directory``, whose sub-directories are the hive ``levels``."""
        partitioning = ds.partitioning(pa.schema([PARTITION_SCHEMA.field(name) for name in levels]), flavor="hive")
        dataset = ds.dataset(directory, format="parquet", partitioning=partitioning)
        for fragment in dataset.get_fragments():
            try:
                version = (fragment.physical_schema.metadata or {}).get(SCHEMA_VERSION_KEY, b"?").decode()
            except (pa.ArrowInvalid, OSError) as error:
                raise StoreError(f"{what}: unreadable file {fragment.path}: {error}") from error
            if version != str(SCHEMA_VERSION):
                raise StoreError(f"{what}: file {fragment.path} has schema version {version}, "
                                 f"this marl_pipeline reads version {SCHEMA_VERSION}")
        try:
            return dataset.to_table(columns=columns)
        except (pa.ArrowInvalid, OSError) as error:
            raise StoreError(f"{what}: unreadable data: {error}") from error

    def _empty(self, stage: str, columns: list[str] | None) -> pa.Table:
        table = STAGE_SCHEMAS[stage].empty_table()
        return table.select(columns) if columns else table

    # -- policies ---------------------------------------------------------------------------------
    def policy_versions(self, run: str, agent: str) -> list[int]:
        base = self.root / f"run={run}" / "policies" / f"agent={agent}"
        return sorted(int(p.name[8:]) for p in base.glob("version=*") if p.is_dir())

    def staging_policy_dir(self, run: str, agent: str, version: int) -> Path:
        """A fresh directory to save a policy into before :meth:`commit_policy` publishes it."""
        target = self.policy_dir(run, agent, version)
        staging = target.parent / f"_staging-{target.name}-{uuid.uuid4().hex}"
        staging.mkdir(parents=True)
        return staging

    def commit_policy(self, staging: Path, run: str, agent: str, version: int) -> Path:
        target = self.policy_dir(run, agent, version)
        self._swap_in(staging, target)
        return target

