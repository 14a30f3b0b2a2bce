"""Policy checkpoints of the store: Hugging Face directories, one per (run, agent, version), committed once.

vLLM and transformers load a policy from a local directory, so a process that needs a version always reads it
from a local path (:meth:`PolicyCheckpoints.fetch`). Where the committed copy lives depends on the store:

- a local store: the version directory in the store itself (``run=R/policies/agent=A/version=V``), made visible
  by a rename from a staging directory, as before. On several Ray nodes this needs a filesystem they all mount.
- an S3 store: the bucket. A version's files are uploaded under an attempt name,
  ``run=R/policies/agent=A/version=V/<attempt>/...``, and one PUT of ``version=V/_manifest.json`` naming the
  attempt and its files is the commit point (the stage partitions' protocol, docs/store.md). A node's local
  directory (``store.policy_cache``) holds copies, each with the manifest it was downloaded from: a copy whose
  attempt is not the committed one is downloaded again, so the cache is an optimisation and never the only copy.
  Any node can therefore start an engine or trainer from any committed version, and a node that dies loses
  nothing but its cache.

The writer of a version (the agent's trainer, on whatever node it runs) uploads it (:meth:`upload`); the driver
makes it visible (:meth:`publish`) after the engine has loaded it, adding its own files (``timing.json``).

The run's other model directories (the built-in model, the built-in reward model) are committed the same way
under ``run=R/models/name=N/version=0`` (``PolicyCheckpoints(..., folder="models", key="name")``).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from marl_pipeline.config import RetentionConfig
from marl_pipeline.store import commits
from marl_pipeline.store import retention as retention_rules
from marl_pipeline.store.storage import Location, modified_time

MANIFEST = commits.MANIFEST
FORMAT = 1


class CheckpointError(RuntimeError):
    """A policy version is not committed, or its manifest is unreadable."""


@dataclass(frozen=True)
class PolicyUpload:
    """A saved, not yet visible policy version: what :meth:`PolicyCheckpoints.publish` commits.

    Small and picklable: a trainer actor returns it to the driver through Ray."""

    run: str
    agent: str
    version: int
    attempt: str
    files: tuple[str, ...]
    """Paths relative to the version directory."""
    staging: str
    """Local store: the staging directory (renamed in by publish). S3: the attempt's prefix in the bucket."""


class PolicyCheckpoints:
    """Policy versions under one store root: committed in the store (local) or the bucket (S3), read locally."""

    def __init__(self, location: Location, cache: Path, folder: str = "policies", key: str = "agent") -> None:
        self.location = location
        self.cache = cache
        """Local directory: the store itself, or this node's cache of an S3 store."""
        self.folder, self.key = folder, key
        """``run=R/<folder>/<key>=A/version=V``: policies by agent, or the run's other models by name."""

    # -- paths ------------------------------------------------------------------------------------
    def local_dir(self, run: str, agent: str, version: int) -> Path:
        """Where ``version`` is (local store) or is cached (S3) on this node; it may not exist yet."""
        return self.cache / f"run={run}" / self.folder / f"{self.key}={agent}" / f"version={version}"

    def _remote_dir(self, run: str, agent: str, version: int | None = None) -> str:
        agent_dir = self.location.path(f"run={run}", self.folder, f"{self.key}={agent}")
        return agent_dir if version is None else f"{agent_dir}/version={version}"

    # -- listing ----------------------------------------------------------------------------------
    def versions(self, run: str, agent: str) -> list[int]:
        """The committed versions of ``agent``: version directories (local) or manifests in the bucket (S3)."""
        if self.location.local:
            base = self.local_dir(run, agent, 0).parent
            return sorted(int(p.name[8:]) for p in base.glob("version=*") if p.is_dir())
        manifests = self.location.fs.glob(f"{self._remote_dir(run, agent)}/version=*/{MANIFEST}")
        return sorted(int(path.rsplit("/", 2)[1][8:]) for path in manifests)

    def agents(self, run: str) -> list[str]:
        """The agents (or models) of ``run`` with a folder of versions."""
        pattern = self.location.path(f"run={run}", self.folder, f"{self.key}=*")
        return sorted(path.rstrip("/").rsplit("=", 1)[-1] for path in self.location.fs.glob(pattern))

    def modified(self, run: str, agent: str, version: int) -> float | None:
        """When ``version`` was committed (seconds since the epoch), from the store's own timestamps."""
        path = self._remote_dir(run, agent, version) + ("" if self.location.local else f"/{MANIFEST}")
        try:
            return modified_time(self.location.fs.info(path))
        except FileNotFoundError:
            return None

    def _manifest(self, run: str, agent: str, version: int) -> dict | None:
        path = f"{self._remote_dir(run, agent, version)}/{MANIFEST}"
        try:
            return _parse(self.location.fs.cat_file(path), self.location.uri_of(path))
        except FileNotFoundError:
            return None

    def read_file(self, run: str, agent: str, version: int, name: str) -> bytes | None:
        """One file of a committed version (``config.json``, ``timing.json``) without fetching the rest."""
        if self.location.local:
            path = self.local_dir(run, agent, version) / name
            return path.read_bytes() if path.is_file() else None
        manifest = self._manifest(run, agent, version)
        if manifest is None or name not in manifest["files"]:
            return None
        return self.location.fs.cat_file(f"{self._remote_dir(run, agent, version)}/{manifest['attempt']}/{name}")

    # -- writing ----------------------------------------------------------------------------------
    def staging(self, run: str, agent: str, version: int) -> Path:
        """A fresh local directory to save a version into before :meth:`upload`."""
        target = self.local_dir(run, agent, version)
        staging = target.parent / f"_staging-{target.name}-{commits.new_attempt()}"
        staging.mkdir(parents=True)
        return staging

    def upload(self, staging: Path, run: str, agent: str, version: int) -> PolicyUpload:
        """Ship a saved version to where it will be committed; nothing is visible yet. On S3 the local staging
        directory is deleted afterwards (the writer, a trainer, holds the weights in memory)."""
        attempt = commits.attempt_in(staging.name) or commits.new_attempt()
        files = tuple(sorted(str(p.relative_to(staging)) for p in staging.rglob("*") if p.is_file()))
        if self.location.local:
            return PolicyUpload(run, agent, version, attempt, files, str(staging))
        prefix = f"{self._remote_dir(run, agent, version)}/{attempt}"
        self.location.fs.put([str(staging / f) for f in files], [f"{prefix}/{f}" for f in files])
        shutil.rmtree(staging, ignore_errors=True)
        return PolicyUpload(run, agent, version, attempt, files, prefix)

    def publish(self, upload: PolicyUpload, extra: dict[str, bytes] | None = None) -> Path | str:
        """Commit an uploaded version, with ``extra`` files added: a rename (local) or one manifest PUT (S3).
        Returns the version's directory (a URI on S3)."""
        extra = extra or {}
        if self.location.local:
            for name, data in extra.items():
                (Path(upload.staging) / name).write_bytes(data)
            target = self.local_dir(upload.run, upload.agent, upload.version)
            commits.swap_in(Path(upload.staging), target)
            return target
        for name, data in extra.items():
            self.location.fs.pipe_file(f"{upload.staging}/{name}", data)
        files = sorted({*upload.files, *extra})
        directory = self._remote_dir(upload.run, upload.agent, upload.version)
        self.location.fs.pipe_file(f"{directory}/{MANIFEST}", json.dumps(
            {"format": FORMAT, "attempt": upload.attempt, "files": files, "committed_at": time.time()}).encode())
        return self.location.uri_of(directory)

    def commit(self, staging: Path, run: str, agent: str, version: int) -> Path | str:
        """Upload and publish a version saved by this process (base policies); on S3 the local copy is dropped
        and fetched back on demand, so the cache only ever holds what the bucket has."""
        return self.publish(self.upload(staging, run, agent, version))

    # -- reading ----------------------------------------------------------------------------------
    def fetch(self, run: str, agent: str, version: int) -> Path:
        """A local directory holding the committed ``version``: the store's own (local store), or this node's
        cached copy, downloaded first when missing or not the committed attempt (S3).

        Raises:
            CheckpointError: the version is not committed (pruned by retention, or never written).
        """
        target = self.local_dir(run, agent, version)
        if self.location.local:
            if not target.is_dir():
                raise self._missing(run, agent, version)
            return target
        manifest = self._manifest(run, agent, version)
        if manifest is None:
            raise self._missing(run, agent, version)
        if _cached_attempt(target) == manifest["attempt"]:
            return target
        staging = self.staging(run, agent, version)
        prefix = f"{self._remote_dir(run, agent, version)}/{manifest['attempt']}"
        for name in manifest["files"]:  # one by one: fs.get of a list puts a file whose dir is absent beside it
            (staging / name).parent.mkdir(parents=True, exist_ok=True)
            self.location.fs.get_file(f"{prefix}/{name}", str(staging / name))
        (staging / MANIFEST).write_text(json.dumps(manifest))
        try:
            os.rename(staging, target)
        except OSError:
            # Another process on this node (the agent's engine and trainer start together) got there first:
            # keep its copy when it is the same attempt (it may be loading from it), else replace it.
            if _cached_attempt(target) == manifest["attempt"]:
                shutil.rmtree(staging, ignore_errors=True)
            else:
                commits.swap_in(staging, target)
        return target

    def _missing(self, run: str, agent: str, version: int) -> CheckpointError:
        where = self.location.uri_of(self._remote_dir(run, agent, version)) if not self.location.local \
            else self.local_dir(run, agent, version)
        noun = "policy" if self.folder == "policies" else self.folder.removesuffix("s")
        return CheckpointError(f"{noun} version {version} of {self.key} {agent!r} in run {run!r} is not stored "
                               f"({where}): it was pruned by store.retention or never committed "
                               f"(kept versions: {self.versions(run, agent)})")

    # -- deleting ---------------------------------------------------------------------------------
    def prune(self, run: str, agent: str, retention: RetentionConfig, protected=()) -> list[int]:
        """Delete the versions ``retention`` does not keep (``store/retention.py``); returns them."""
        if self.location.local:
            versions = {v: self.local_dir(run, agent, v) for v in self.versions(run, agent)}
            return retention_rules.prune(versions, retention, protected)
        versions = self.versions(run, agent)
        keep = retention_rules.retained_versions(versions, retention, protected)
        doomed = [v for v in versions if v not in keep]
        # The manifest first, in one request: a version is gone for every reader at once, then its files go.
        if doomed:
            self.location.fs.rm([f"{self._remote_dir(run, agent, v)}/{MANIFEST}" for v in doomed])
        for version in doomed:
            self.location.fs.rm(self._remote_dir(run, agent, version), recursive=True)
            shutil.rmtree(self.local_dir(run, agent, version), ignore_errors=True)
        return doomed

    def garbage(self, older_than: float, run: str = "*") -> list[str]:
        """Leftovers older than ``older_than`` seconds (of ``run``, or of every run): local staging directories,
        and on S3 uploaded attempts that no manifest names (a trainer or driver that died before the commit point)."""
        local = [str(p) for p in self.cache.glob(f"run={run}/{self.folder}/{self.key}=*/_staging-*")
                 if _is_old(p.name, older_than)]
        remote: list[str] = []
        if not self.location.local:
            pattern = self.location.path(f"run={run}", self.folder, f"{self.key}=*", "version=*", "*")
            for path in self.location.fs.glob(pattern):
                directory, name = path.rsplit("/", 1)
                if name == MANIFEST or not _is_old(name, older_than):
                    continue
                try:
                    committed = _parse(self.location.fs.cat_file(f"{directory}/{MANIFEST}"), directory)["attempt"]
                except FileNotFoundError:
                    committed = None
                if name != committed:
                    remote.append(path)
        for path in local:
            shutil.rmtree(path, ignore_errors=True)
        for path in remote:
            self.location.fs.rm(path, recursive=True)
        return local + remote


def _parse(data: bytes, where: str) -> dict:
    try:
        record = json.loads(data)
        if record["format"] != FORMAT:
            raise ValueError(f"format {record['format']}, this marl_pipeline reads {FORMAT}")
        return {"attempt": str(record["attempt"]), "files": list(record["files"])}
    except (ValueError, KeyError, TypeError) as error:
        raise CheckpointError(f"unreadable policy manifest {where}: {error}") from None


def _cached_attempt(directory: Path) -> str | None:
    try:
        return json.loads((directory / MANIFEST).read_text())["attempt"]
    except (OSError, ValueError, KeyError):
        return None


def _is_old(name: str, older_than: float) -> bool:
    age = commits.attempt_age(name)
    return age is not None and age > older_than
