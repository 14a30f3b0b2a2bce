"""A node's cores shared by the compute actors that are working at the moment (engines and trainers).

A fixed split (each actor its share of the reservations, cluster/spawn.py: ``shared_threads``) idles cores whenever
an actor waits: at staleness 0 a solver's engine that finished its turns waits while the verifier's computes, and a
trainer waits through rollout. Here each actor says when it works, in a slot of its own on the node (a one-byte file
in a tmpfs directory shared by the actors of one Ray cluster on that node), and before each unit of work (an engine
step, a trainer's pass) takes the threads its weight gives it among the actors working then:
``floor(cores * weight / busy weights)``, at least 1. Reading the slots is a few memory reads; the directory is
listed again at most every ``RESCAN_S``.

Why not Ray: Ray's resources are reservations fixed when an actor starts; torch's (OpenMP's) thread count is per
calling thread and can change between parallel regions, which is what this uses (``torch._C.set_num_threads``:
vLLM's CPU worker replaces ``torch.set_num_threads`` with a no-op once it has started).
"""

from __future__ import annotations

import itertools
import mmap
import os
import time
import zlib
from pathlib import Path

_slots = itertools.count()
RESCAN_S = 0.5
"""How often the slots of the node's other actors are listed again (an actor started or gone)."""


class CoreShare:
    """This process's share of its node's cores among the compute actors working now (one per actor)."""

    def __init__(self, directory: str | Path, cores: int, weight: float = 1.0) -> None:
        """``directory``: node-local and shared by the actors that share the cores (:func:`share_directory`);
        ``cores``: the node's cores these actors share; ``weight``: this actor's claim (its CPU reservation)."""
        if cores < 1 or weight <= 0:
            raise ValueError(f"a core share needs cores >= 1 and weight > 0, got {cores} and {weight}")
        self.directory, self.cores, self.weight = Path(directory), cores, weight
        self.directory.mkdir(parents=True, exist_ok=True)
        # A slot: its name carries the weight and the pid (a dead actor's slot is ignored, then removed).
        self._path = self.directory / f"{os.getpid()}.{next(_slots)}-{weight:g}"
        self._path.write_bytes(b"\0")
        self._own = self._map(self._path)
        self._peers: dict[Path, tuple[mmap.mmap, float]] = {}
        self._scanned = 0.0
        self._threads = 0

    @staticmethod
    def _map(path: Path) -> mmap.mmap:
        with open(path, "r+b") as file:
            return mmap.mmap(file.fileno(), 1)

    def working(self, busy: bool) -> int:
        """Say whether this actor works now; returns the threads it takes, set for the calling thread."""
        self._own[0] = 1 if busy else 0
        return self.take() if busy else self._threads

    def take(self) -> int:
        """Set the calling thread's torch threads to this actor's share now (call before each unit of work)."""
        threads = self.threads()
        if threads != self._threads:
            import torch

            torch._C.set_num_threads(threads)  # vLLM replaces torch.set_num_threads with a no-op
            self._threads = threads
        return threads

    def threads(self) -> int:
        """``floor(cores * weight / the weights of the actors working now)`` (this one counted), at least 1."""
        now = time.monotonic()
        if now - self._scanned > RESCAN_S:
            self._rescan()
            self._scanned = now
        busy = self.weight + sum(weight for slot, weight in self._peers.values() if slot[0])
        return max(1, min(self.cores, int(self.cores * self.weight / busy)))

    def _rescan(self) -> None:
        found = {}
        for path in self.directory.iterdir():
            if path == self._path:
                continue
            owner, _, weight = path.name.rpartition("-")
            if not _alive(int(owner.split(".")[0])):
                path.unlink(missing_ok=True)
                continue
            try:
                found[path] = self._peers.get(path) or (self._map(path), float(weight))
            except (OSError, ValueError):  # a slot being created (still empty) or just removed: next scan
                continue
        for path in self._peers.keys() - found.keys():
            self._peers[path][0].close()
        self._peers = found

    def close(self) -> None:
        """Leave the share (the actor stops computing for good)."""
        self._own.close()
        self._path.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def share_directory(cluster: str) -> Path:
    """The node-local directory of one Ray cluster's core shares (tmpfs where there is one)."""
    root = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp")
    return root / f"marl-cores-{zlib.crc32(cluster.encode()):08x}"  # hash() differs between processes
