"""The commit protocol of the experience store: attempts, manifests, the local swap, and garbage collection.

Every commit of a (stage, step, micro_batch) partition is an *attempt* with its own name, sortable by
time (``<ns since epoch, hex>-<random>``). Its data files are ``agent=A/part-<attempt>.parquet`` and a
``_manifest.json`` in the partition directory names the committed attempt and its files. Readers read
the manifest, then exactly the files it lists: a commit is visible all at once or not at all.

- Local disk: the attempt (data and manifest) is written into ``_staging-micro_batch=K-<attempt>`` and
  the directory is renamed into place, or atomically exchanged with the committed one on a re-commit
  (Linux ``renameat2(RENAME_EXCHANGE)``), so even a bare glob of the tree never sees a partial commit.
- S3 (no rename): the attempt's files are written in place under their attempt name, then the manifest
  is replaced with one PUT (atomic on S3); the replaced attempt's files are deleted after the swap.

Leftovers of writers that died before their commit (a staging directory, or part files that no manifest
names) are invisible to readers and deleted once older than a grace period, at the next commit of that
partition or by :func:`collect_garbage` (``ExperienceStore.vacuum``).
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from marl_pipeline.store.storage import Location, replace_file

MANIFEST = "_manifest.json"
MANIFEST_FORMAT = 1
GRACE_SECONDS = 3600.0
"""Leftovers younger than this are not collected: they may belong to a writer still at work."""
_ATTEMPT = re.compile(r"([0-9a-f]{16})-[0-9a-f]{8}")


def new_attempt() -> str:
    return f"{time.time_ns():016x}-{uuid.uuid4().hex[:8]}"


def attempt_in(name: str) -> str | None:
    """The attempt named inside ``name`` (a staging directory's, a part file's); None if it holds none."""
    match = _ATTEMPT.search(name)
    return None if match is None else match.group(0)


def attempt_age(name: str) -> float | None:
    """Seconds since the attempt named inside ``name`` started; None if ``name`` holds no attempt."""
    match = _ATTEMPT.search(name)
    return None if match is None else time.time() - int(match.group(1), 16) / 1e9


@dataclass(frozen=True)
class Manifest:
    """The committed attempt of one partition: who wrote which files, under which schema version."""

    attempt: str
    schema_version: int
    files: dict[str, str]
    """Agent -> data file, relative to the partition directory."""
    rows: dict[str, int]

    def to_bytes(self) -> bytes:
        return json.dumps({"format": MANIFEST_FORMAT, "attempt": self.attempt, "schema_version": self.schema_version,
                           "files": self.files, "rows": self.rows, "committed_at": time.time()}).encode()

    @classmethod
    def from_bytes(cls, data: bytes, where: str) -> Manifest:
        try:
            record = json.loads(data)
            if record["format"] != MANIFEST_FORMAT:
                raise ValueError(f"manifest format {record['format']}, this marl_pipeline reads {MANIFEST_FORMAT}")
            return cls(record["attempt"], int(record["schema_version"]), dict(record["files"]), dict(record["rows"]))
        except (ValueError, KeyError, TypeError) as error:
            raise ValueError(f"unreadable commit manifest {where}: {error}") from error


def read_manifest(location: Location, partition: str) -> Manifest | None:
    """The partition's manifest; None when it is not committed."""
    path = f"{partition}/{MANIFEST}"
    try:
        data = location.fs.cat_file(path)
    except FileNotFoundError:
        if location.local and os.path.isdir(partition):
            return _legacy_manifest(partition)
        return None
    return Manifest.from_bytes(data, location.uri_of(path))


def _legacy_manifest(partition: str) -> Manifest:
    # Schema version 1 wrote local partitions without a manifest; a local directory only ever appears by
    # rename, so an existing one without a manifest is a whole, committed, version-1 partition.
    files = {p.parent.name.removeprefix("agent="): str(p.relative_to(partition))
             for p in sorted(Path(partition).glob("agent=*/*.parquet"))}
    return Manifest("legacy", 1, files, {})


def write_manifest(location: Location, partition: str, manifest: Manifest) -> None:
    """Replace the partition's manifest at once: the commit point on S3 (one PUT)."""
    replace_file(location, f"{partition}/{MANIFEST}", manifest.to_bytes())


# -- local directories ------------------------------------------------------------------------------
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two directories (Linux renameat2); False where the OS or filesystem lacks it.

    Hand-written because neither os nor shutil exposes RENAME_EXCHANGE, and it is the one way to replace a
    directory tree on local disk with no instant where neither version is there.
    """
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:
        return False
    return renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0


def swap_in(staging: Path, target: Path) -> None:
    """Make ``staging`` visible as ``target``, replacing what was there; the replaced tree is deleted."""
    try:
        os.rename(staging, target)  # atomic when nothing is committed yet
        return
    except OSError:
        if not target.exists():
            raise
    if not _exchange(staging, target):
        # Fallback without renameat2: a reader in between sees the partition absent, never a mix.
        old = target.parent / f"_replaced-{target.name}-{new_attempt()}"
        os.rename(target, old)
        os.rename(staging, target)
        staging = old
    shutil.rmtree(staging, ignore_errors=True)


# -- garbage ---------------------------------------------------------------------------------------
def _is_old(name: str, older_than: float) -> bool:
    age = attempt_age(name)
    return age is not None and age > older_than


def partition_garbage(location: Location, partition: str, manifest: Manifest | None, older_than: float) -> list[str]:
    """Leftovers of one partition's dead or replaced attempts, older than ``older_than`` seconds."""
    parent, name = partition.rsplit("/", 1)
    if location.local:
        return [str(p) for p in Path(parent).glob(f"_staging-{name}-*") if _is_old(p.name, older_than)]
    try:
        paths = location.fs.find(partition)
    except FileNotFoundError:
        return []
    keep = {f"{partition}/{relative}" for relative in (manifest.files.values() if manifest else ())}
    return [p for p in paths if p.endswith(".parquet") and p not in keep and _is_old(p.rsplit("/", 1)[1], older_than)]


def collect_garbage(location: Location, older_than: float, run: str = "*") -> list[str]:
    """Delete every stage-partition leftover older than ``older_than`` seconds (of ``run``, or of every run); returns
    what was deleted (policy checkpoints' leftovers are ``PolicyCheckpoints.garbage``'s)."""
    garbage: list[str] = []
    if location.local:
        for pattern in (f"run={run}/stage=*/step=*/_staging-*", f"run={run}/stage=*/step=*/_replaced-*"):
            garbage += [str(p) for p in Path(location.base).glob(pattern) if _is_old(p.name, older_than)]
    else:
        files = location.fs.glob(location.path(f"run={run}/stage=*/step=*/micro_batch=*/agent=*/*.parquet"))
        for partition in sorted({path.rsplit("/", 2)[0] for path in files}):
            garbage += partition_garbage(location, partition, read_manifest(location, partition), older_than)
    remove(location, garbage)
    return garbage


def remove(location: Location, paths: list[str]) -> None:
    """Delete leftovers: staging directories on local disk, part files on S3 (one batched request)."""
    if not location.local:
        if paths:
            location.fs.rm(paths)
        return
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)
