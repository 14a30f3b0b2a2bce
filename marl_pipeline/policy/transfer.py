"""Weight sync by broadcast: an agent's trainer sends a policy version's weights to all its engine replicas at once
over a torch.distributed process group of their own (gloo on CPU, NCCL on GPUs), in buckets, without the driver.

The group is built from torch's store and backend classes (``TCPStore``, ``ProcessGroupGloo``/``ProcessGroupNCCL``),
not with ``init_process_group``: both ends already have a default group that is not this one (vLLM's, in the
engine's process; FSDP's, in a sharded trainer), and replicas come and go (restarts, resizing), so the group is
remade whenever its members change. Why not Ray's collective groups or Ray Direct Transport: their gloo transport
initialises torch's default process group and takes its world to be theirs (docs/ARCHITECTURE.md, "Weight sync by
broadcast"). This is what verl and OpenRLHF do (a group per trainer and its engines beside torch's default one).

Every tensor travels as bytes, packed into ``uint8`` buckets at aligned offsets, so one bucket holds any mix of
dtypes and a receiver reads each tensor back as a view of its bucket (no copy).
"""

from __future__ import annotations

import datetime
import math
import socket
import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist

BUCKET_BYTES = 256 * 2**20
"""Most bytes one broadcast carries: a sender's and a receiver's extra memory is the weights, not twice them."""
TIMEOUT = datetime.timedelta(seconds=120)
"""A member that does not join or answer by then fails the sync (a dead replica), rather than hanging the run."""
_ALIGN = 64  # bytes: every tensor starts where a view of its dtype may


@dataclass(frozen=True)
class Manifest:
    """The tensors of one policy's weights, in order: what a receiver allocates before the bytes arrive."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    """``torch.float32`` etc. as ``str(dtype)``: plain data, for any pickler."""
    backend: str = "gloo"
    """The sender's: ``nccl`` where its buckets are on a GPU (receivers receive on theirs), else ``gloo``."""

    def buckets(self, bucket_bytes: int = BUCKET_BYTES) -> list[list[tuple[int, int]]]:
        """Each bucket's tensors as (index, byte offset), consecutive tensors until ``bucket_bytes`` (a larger tensor
        alone)."""
        buckets: list[list[tuple[int, int]]] = [[]]
        used = 0
        for index in range(len(self.names)):
            size = self.nbytes(index)
            if buckets[-1] and used + size > bucket_bytes:
                buckets.append([])
                used = 0
            buckets[-1].append((index, used))
            used += -(-size // _ALIGN) * _ALIGN
        return buckets if buckets[-1] else []

    def nbytes(self, index: int) -> int:
        return _dtype(self.dtypes[index]).itemsize * math.prod(self.shapes[index])

    def bucket_size(self, bucket: list[tuple[int, int]]) -> int:
        index, offset = bucket[-1]
        return offset + self.nbytes(index)


def manifest_of(named_tensors: list[tuple[str, torch.Tensor]], backend: str = "gloo") -> Manifest:
    return Manifest(tuple(name for name, _ in named_tensors), tuple(tuple(t.shape) for _, t in named_tensors),
                  tuple(str(t.dtype) for _, t in named_tensors), backend)


def pack(named_tensors: list[tuple[str, torch.Tensor]], device: torch.device,
         bucket_bytes: int = BUCKET_BYTES) -> tuple[Manifest, list[torch.Tensor]]:
    """A snapshot of the tensors as the buckets a sender broadcasts (one copy, on ``device``)."""
    manifest = manifest_of(named_tensors, "nccl" if device.type == "cuda" else "gloo")
    buckets = []
    for plan in manifest.buckets(bucket_bytes):
        buffer = torch.empty(manifest.bucket_size(plan), dtype=torch.uint8, device=device)
        for index, offset in plan:
            tensor = named_tensors[index][1].detach()
            _view(buffer, manifest, index, offset).copy_(tensor)
        buckets.append(buffer)
    return manifest, buckets


def unpack(manifest: Manifest, buckets: list[torch.Tensor],
           bucket_bytes: int = BUCKET_BYTES) -> list[tuple[str, torch.Tensor]]:
    """The named tensors of received buckets, as views of them."""
    return [(manifest.names[index], _view(buffer, manifest, index, offset))
            for plan, buffer in zip(manifest.buckets(bucket_bytes), buckets) for index, offset in plan]


def _view(buffer: torch.Tensor, manifest: Manifest, index: int, offset: int) -> torch.Tensor:
    part = buffer[offset:offset + manifest.nbytes(index)]
    return part.view(_dtype(manifest.dtypes[index])).view(manifest.shapes[index])


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype")
    return dtype


@dataclass(frozen=True)
class SyncGroup:
    """One membership of an agent's sync group: the sender is rank 0, the replicas ranks 1 to ``world - 1``."""

    address: str
    """``host:port`` of the store the sender hosts, where the members meet."""
    name: str
    """Unique per membership: a new one whenever the replicas change."""
    world: int


class Endpoint:
    """One process's side of its sync groups: the store it hosts (a sender) and the group it is in now, remade when
    a call names another membership."""

    def __init__(self) -> None:
        self._host: dist.TCPStore | None = None
        self._name: str | None = None
        self._group = None

    def address(self) -> str:
        """Where this process hosts its groups' store (started on the first call)."""
        if self._host is None:
            host = _node_address()
            self._host = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
        return f"{self._host.host}:{self._host.port}"

    def group(self, group: SyncGroup, rank: int, backend: str):
        """The process group of ``group``, joined as ``rank`` (every member calls this before the first transfer)."""
        if group.name != self._name:
            self._group = self._name = None
            host, port = group.address.rsplit(":", 1)
            store = self._host if rank == 0 else dist.TCPStore(host, int(port), is_master=False, timeout=TIMEOUT)
            self._group = _process_group(dist.PrefixStore(f"{group.name}/", store), rank, group.world, backend)
            self._name = group.name
        return self._group

    def send(self, group: SyncGroup, buckets: list[torch.Tensor]) -> None:
        process_group = self.group(group, 0, "nccl" if buckets and buckets[0].is_cuda else "gloo")
        for buffer in buckets:
            process_group.broadcast(buffer, 0).wait()

    def receive(self, group: SyncGroup, rank: int, manifest: Manifest,
                bucket_bytes: int = BUCKET_BYTES) -> list[tuple[str, torch.Tensor]]:
        if manifest.backend == "nccl" and not torch.cuda.is_available():
            raise RuntimeError("the trainer sends its weights from a GPU (NCCL) and this replica's process sees none: "
                               "give the engine a GPU, or use ray.weight_sync: object_store")
        process_group = self.group(group, rank, manifest.backend)
        device = torch.device("cuda" if manifest.backend == "nccl" else "cpu")
        buckets = [torch.empty(manifest.bucket_size(plan), dtype=torch.uint8, device=device)
                   for plan in manifest.buckets(bucket_bytes)]
        for buffer in buckets:
            process_group.broadcast(buffer, 0).wait()
        return unpack(manifest, buckets, bucket_bytes)

    def close(self) -> None:
        """Leave the group (a failed transfer: the next call names a new membership)."""
        self._group = self._name = None


class Outbox:
    """A sender's staged versions, each kept until a newer one is sent (for a retry, and for a replica restarted
    meanwhile: :meth:`copy`), and its endpoint."""

    def __init__(self) -> None:
        self.endpoint = Endpoint()
        self._staged: dict[int, tuple[Manifest, list[torch.Tensor]]] = {}
        self._lock = threading.Lock()  # staged in the trainer's call order, sent from its broadcast thread

    def stage(self, version: int, named_tensors: list[tuple[str, torch.Tensor]],
              device: torch.device) -> Manifest | None:
        """A snapshot of ``version``'s tensors, packed on ``device``; None where there are none (no copy to send)."""
        if not named_tensors:
            return None
        manifest, buckets = pack(named_tensors, device)
        with self._lock:
            self._staged[version] = (manifest, buckets)
        return manifest

    def send(self, group: SyncGroup, version: int) -> int:
        """Broadcast a staged version to ``group``; the versions staged before it are dropped once it is sent."""
        buckets = self._get(version)[1]
        try:
            self.endpoint.send(group, buckets)
        except BaseException:
            self.endpoint.close()  # the members may be half-way: the retry names a new group
            raise
        with self._lock:
            for older in [v for v in self._staged if v < version]:
                del self._staged[older]
        return version

    def copy(self, version: int) -> list[tuple[str, torch.Tensor]]:
        """A staged version's tensors copied to host memory (a view of a bucket would pickle the whole bucket)."""
        return [(name, tensor.to("cpu", copy=True)) for name, tensor in unpack(*self._get(version))]

    def _get(self, version: int) -> tuple[Manifest, list[torch.Tensor]]:
        with self._lock:
            staged = self._staged.get(version)
            if staged is None:
                raise ValueError(f"version {version} is not staged for a broadcast; staged: {sorted(self._staged)}")
            return staged


def _process_group(store, rank: int, world: int, backend: str):
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = TIMEOUT
        return dist.ProcessGroupNCCL(store, rank, world, options)
    options = dist.ProcessGroupGloo._Options()
    options._timeout = TIMEOUT
    # This node's address, not the hostname's: that may resolve to loopback, unreachable from other nodes.
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=_node_address())]
    return dist.ProcessGroupGloo(store, rank, world, options)


def _node_address() -> str:
    """This node's address as Ray knows it (other nodes reach it there), else the hostname's."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:
        pass
    return socket.gethostbyname(socket.gethostname())
