"""Swapped trainers: a budget of N trainer worker actors serves every agent of a run, each agent's trainer state
moved into a worker for its calls and out to the Ray object store when another agent needs that worker.

An agent is served by one worker (agent i by worker i mod N, ``cluster/specs.assign_workers``), which keeps a
``PolicyTrainer`` shell per agent it serves: the modules, tokenizer and options, with no parameter storage while
the agent is swapped out. What moves is every tensor the next call needs: the parameters, their gradients between
the micro-batches of a step, AdamW's moments and step counts, the KL reference's frozen copy when the penalty is
on, and torch's RNG state (one process serves several agents, and a resident trainer's RNG is its own). Moved as
raw bytes, so the results are bit-identical to a resident trainer's (tested), whatever the dtype.

Why the Ray object store, not the driver's memory or disk: it is shared memory on the worker's node, so a swap out
is one copy in (``ray.put``) and a swap in one copy out (``ray.get`` maps the buffer without copying; the copy is
into fresh parameter storage), the driver's memory and network stay out of the way; Ray spills it to disk by
itself when the store fills, so disk is the fallback, not the cost of every swap.

An agent is swapped out when its worker must serve another agent (on demand, not after every call): the
optimizer step, weight export and checkpoint the orchestrator issues together run on the loaded state, and the
train stage alternates the order of its calls from one micro-batch to the next (``stages.training.issue_order``)
so that the agent a worker ends a micro-batch with starts the next one. With more agents than workers, every
agent's state leaves the worker between its optimizer steps.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import ray
import torch

from marl_pipeline.training.trainer import PolicyTrainer


def _to_bytes(tensor: torch.Tensor) -> tuple[np.ndarray, torch.dtype, tuple[int, ...]]:
    """A view of the tensor's bytes (no copy on the CPU; a GPU's tensor is copied to host memory), with what restores
    it."""
    return (tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy(), tensor.dtype,
            tuple(tensor.shape))


def _from_bytes(packed: tuple[np.ndarray, torch.dtype, tuple[int, ...]], device: torch.device) -> torch.Tensor:
    """A new tensor on ``device``, owning a copy of the packed bytes (the object store's buffer is read-only and
    shared)."""
    data, dtype, shape = packed
    if device.type == "cpu":
        return torch.from_numpy(data.copy()).view(dtype).reshape(shape)
    return torch.from_numpy(data).to(device).view(dtype).reshape(shape)  # the copy is the move


def pack_state(trainer: PolicyTrainer) -> dict:
    """Views of every tensor of ``trainer``'s state, keyed by parameter position (no copy)."""
    params = list(trainer.model.parameters())
    tensors = {}
    for i, param in enumerate(params):
        tensors[f"param.{i}"] = _to_bytes(param.data)
        if param.grad is not None:
            tensors[f"grad.{i}"] = _to_bytes(param.grad)
        for name, value in trainer.optimizer.state.get(param, {}).items():
            tensors[f"optim.{i}.{name}"] = _to_bytes(value)
    if trainer.reference is not None:
        for i, param in enumerate(trainer.reference.parameters()):
            tensors[f"reference.{i}"] = _to_bytes(param.data)
    tensors["rng"] = _to_bytes(torch.get_rng_state())
    return tensors


def release_state(trainer: PolicyTrainer) -> None:
    """Drop ``trainer``'s tensors (its shell keeps the modules with empty parameters)."""
    for model in (trainer.model, trainer.reference):
        for param in model.parameters() if model is not None else ():
            param.data = torch.empty(0, dtype=param.dtype, device=param.device)
            param.grad = None
    trainer.optimizer.state.clear()


def unpack_state(trainer: PolicyTrainer, tensors: dict) -> None:
    """Put a packed state back into ``trainer``'s shell."""
    cpu = torch.device("cpu")
    params = list(trainer.model.parameters())
    for i, param in enumerate(params):
        param.data = _from_bytes(tensors[f"param.{i}"], trainer.device)
        if f"grad.{i}" in tensors:
            param.grad = _from_bytes(tensors[f"grad.{i}"], trainer.device)
        prefix = f"optim.{i}."
        moments = {key[len(prefix):]: _from_bytes(value, cpu if key == f"{prefix}step" else trainer.device)
                   for key, value in tensors.items() if key.startswith(prefix)}  # AdamW counts steps on the CPU
        if moments:
            trainer.optimizer.state[param] = moments
    if trainer.reference is not None:
        for i, param in enumerate(trainer.reference.parameters()):
            param.data = _from_bytes(tensors[f"reference.{i}"], trainer.device)
    torch.set_rng_state(_from_bytes(tensors["rng"], cpu))


def state_bytes(tensors: dict) -> int:
    return sum(data.nbytes for data, _, _ in tensors.values())


@dataclass(frozen=True)
class AgentSpec:
    """What a worker needs to build an agent's trainer: ``PolicyTrainer(model_dir, version, **options)``."""

    model_dir: str
    version: int
    options: dict


@dataclass
class SwapStats:
    """A worker's swaps so far: how many, bytes and seconds each way."""

    swaps_out: int = 0
    swaps_in: int = 0
    bytes_out: int = 0
    bytes_in: int = 0
    seconds_out: float = 0.0
    seconds_in: float = 0.0


class TrainerWorker:
    """One trainer worker: serves the calls of several agents' trainers, one agent's state loaded at a time."""

    def __init__(self, agents: dict[str, AgentSpec],
                 build: Callable[[str, AgentSpec], PolicyTrainer] | None = None) -> None:
        self.specs = agents
        # How an agent's trainer is built on first use: from ``model_dir`` by default; a run's workers build the
        # store's trainer, which fetches its version on this node and uploads new ones (cluster/spawn.py).
        self.build = build or (lambda agent, spec: PolicyTrainer(spec.model_dir, spec.version, **spec.options))
        self.trainers: dict[str, PolicyTrainer] = {}
        self.swapped: dict[str, ray.ObjectRef] = {}
        self.loaded: str | None = None
        self.stats = SwapStats()

    def call(self, agent: str, method: str, *args, **kwargs):
        """``PolicyTrainer.<method>(*args, **kwargs)`` on ``agent``'s trainer, swapping it in first if need be."""
        if agent not in self.specs:
            raise KeyError(f"agent {agent!r} is not served by this trainer worker (it serves {sorted(self.specs)})")
        if method == "policy_version":  # answered from the shell: readiness checks must not swap anything
            return self.trainers[agent].version if agent in self.trainers else self.specs[agent].version
        result = getattr(self._load(agent), method)(*args, **kwargs)
        if method == "apply_step":  # the version's timing.json records what swapping has cost so far
            stats = self.stats
            result = replace(result, swaps=stats.swaps_in + stats.swaps_out,
                             swap_seconds=stats.seconds_in + stats.seconds_out)
        return result

    def _load(self, agent: str) -> PolicyTrainer:
        if self.loaded == agent:
            return self.trainers[agent]
        if self.loaded is not None:
            self._swap_out(self.loaded)
        if agent in self.trainers:
            self._swap_in(agent)
        else:  # first call: built from the store like a resident trainer (the constructor seeds the global RNG)
            spec = self.specs[agent]
            self.trainers[agent] = self.build(agent, spec)
        self.loaded = agent
        return self.trainers[agent]

    def _swap_out(self, agent: str) -> None:
        started = time.perf_counter()
        tensors = pack_state(self.trainers[agent])
        self.swapped[agent] = ray.put(tensors)
        release_state(self.trainers[agent])
        self.stats.bytes_out += state_bytes(tensors)
        del tensors  # the views were the last references to the old storage
        self.stats.swaps_out += 1
        self.stats.seconds_out += time.perf_counter() - started
        self.loaded = None

    def _swap_in(self, agent: str) -> None:
        started = time.perf_counter()
        ref = self.swapped.pop(agent)
        tensors = ray.get(ref)
        unpack_state(self.trainers[agent], tensors)
        self.stats.bytes_in += state_bytes(tensors)
        del tensors, ref  # the last reference: the object store frees the swapped copy
        self.stats.swaps_in += 1
        self.stats.seconds_in += time.perf_counter() - started

    def swap_stats(self) -> SwapStats:
        return self.stats


class SwappedTrainer:
    """A driver-side handle to one agent's trainer on a :class:`TrainerWorker` actor, with a trainer actor's
    interface: ``handle.accumulate.remote(batch)`` returns an ``ObjectRef``. The worker's actor queue keeps an
    agent's calls in the order they were issued, as a resident trainer actor's does."""

    def __init__(self, worker: ray.actor.ActorHandle, agent: str) -> None:
        self.worker, self.agent = worker, agent

    def __getattr__(self, method: str) -> _RemoteMethod:
        if method.startswith("_"):
            raise AttributeError(method)
        return _RemoteMethod(self.worker, self.agent, method)


@dataclass(frozen=True)
class _RemoteMethod:
    worker: ray.actor.ActorHandle
    agent: str
    method: str

    def remote(self, *args, **kwargs) -> ray.ObjectRef:
        return self.worker.call.remote(self.agent, self.method, *args, **kwargs)


def actor_handles(trainers: dict) -> list[ray.actor.ActorHandle]:
    """The distinct actors behind a run's trainer handles (resident trainers, or the workers of swapped ones)."""
    handles = {}
    for trainer in trainers.values():
        handle = trainer.worker if isinstance(trainer, SwappedTrainer) else trainer
        handles[handle._actor_id] = handle
    return list(handles.values())
