"""Where the experience store's bytes live: one fsspec filesystem (local or s3fs) and its pyarrow view.

Everything the store does goes through these two handles, so a local directory and ``s3://`` share
one code path; only the commit point differs (docs/store.md).
"""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import dataclass
from pathlib import Path

import fsspec
import pyarrow.fs as pafs

from marl_pipeline.config import StoreConfig


@dataclass(frozen=True)
class Location:
    """A store root on one filesystem."""

    fs: fsspec.AbstractFileSystem
    """For listing, manifests and deletes."""
    arrow: pafs.FileSystem
    """The same filesystem for pyarrow.dataset / parquet reads and writes."""
    base: str
    """Root of the store inside ``fs`` (no scheme, no trailing slash)."""
    local: bool
    uri: str
    """The root as a URI users can paste (``s3://bucket/prefix`` or an absolute path)."""

    def path(self, *parts: str) -> str:
        return "/".join((self.base, *parts))

    def uri_of(self, path: str) -> str:
        return path if self.local else f"s3://{path}"


def modified_time(info: dict) -> float | None:
    """An fsspec ``info`` entry's modification time in seconds since the epoch: ``mtime`` on local disk,
    ``LastModified`` on S3."""
    if "mtime" in info:
        return float(info["mtime"])
    stamp = info.get("LastModified")
    return None if stamp is None else stamp.timestamp()


def open_location(config: StoreConfig) -> Location:
    """The filesystem of ``config.uri``: a local directory, or S3 through s3fs with the config's endpoint and keys.

    Settings left None fall back to botocore's standard chain (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ~/.aws, ...).
    """
    uri = config.uri
    if not uri.startswith("s3://"):
        base = os.path.abspath(uri.removeprefix("file://"))
        return Location(fsspec.filesystem("file"), pafs.LocalFileSystem(), base.rstrip("/") or "/", True, base)
    import s3fs

    client_kwargs = {"region_name": config.region} if config.region else {}
    # No listings cache: another process's commit must be seen by the next listing, not a stale one.
    fs = s3fs.S3FileSystem(key=config.access_key_id, secret=config.secret_access_key,
                           endpoint_url=config.endpoint_url, client_kwargs=client_kwargs,
                           use_listings_cache=False, skip_instance_cache=True)
    base = uri.removeprefix("s3://").rstrip("/")
    if not base:
        raise ValueError(f"store URI {uri!r} names no bucket")
    return Location(fs, pafs.PyFileSystem(pafs.FSSpecHandler(fs)), base, False, f"s3://{base}")


def policy_root(config: StoreConfig, location: Location) -> Path:
    """Local directory for policy checkpoints: the store itself, or this node's cache of a remote store (a
    relative ``policy_cache`` and the default are taken from the working directory of the process that opens
    the store, so each Ray node keeps its own).

    Checkpoints are Hugging Face directories that vLLM and transformers load from a local path.
    """
    if location.local:
        return Path(location.base)
    if config.policy_cache:
        return Path(config.policy_cache).absolute()
    return (Path(".marl") / "cache" / location.base).absolute()


def read_json(location: Location, path: str) -> dict | None:
    """A JSON record at ``path`` in the store; None when there is none."""
    try:
        return json.loads(location.fs.cat_file(path))
    except FileNotFoundError:
        return None


def write_json(location: Location, path: str, record: dict) -> None:
    """Replace a JSON record at once (:func:`replace_file`)."""
    replace_file(location, path, json.dumps(record).encode())


def replace_file(location: Location, path: str, data: bytes) -> None:
    """Replace the file at ``path`` at once, so a reader sees the old bytes or the new, never a part: a temporary
    file renamed over it (local), or one PUT (S3, atomic per object)."""
    if not location.local:
        location.fs.pipe_file(path, data)
        return
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    temporary = target.with_name(f".{target.name}.{uuid.uuid4().hex}")
    temporary.write_bytes(data)
    os.replace(temporary, target)
