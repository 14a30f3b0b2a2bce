"""A run's engine actor: the asynchronous engine (inference/async_engine.py) started from a policy version in the
store, fetched on the node it runs on, and reporting its process's CPU for the split of the cores (cluster/cores.py).
It loads a hybrid agent's weights from the process that holds them (:class:`HeldWeights`).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import ray

from marl_pipeline.cluster.cores import CpuReport, cpu_report
from marl_pipeline.cluster.heap import collector_paused
from marl_pipeline.config import StoreConfig
from marl_pipeline.inference.async_engine import AsyncRolloutEngine
from marl_pipeline.policy.lora import is_adapter_checkpoint
from marl_pipeline.store import ExperienceStore


@dataclass(frozen=True)
class HeldWeights:
    """A policy version's weights kept in the process of a hybrid agent's trainer (cluster/hybrid.py), in place of a
    copy in the object store: the engine in that process takes them as they are; another replica asks for them."""

    holder: ray.actor.ActorHandle
    holder_id: str
    version: int


class StoreAsyncEngine(AsyncRolloutEngine):
    """A run's engine: the asynchronous engine, started from a policy version in the store, fetched on the node it
    runs on."""

    def __init__(self, store: StoreConfig, run: str, agent: str, version: int, after: list | None = None,
                 **options) -> None:
        """``after``: references to wait for before the version is read (its trainer preparing version 0); vLLM,
        the engine's longest import, is imported meanwhile."""
        with collector_paused():  # vLLM's import and the engine's build (cluster/heap.py)
            if after:
                import vllm  # noqa: F401

                ray.get(after)
            model_dir, adapter_dir = engine_dirs(ExperienceStore(store), run, agent, version)
            super().__init__(model_dir, version, adapter_dir=adapter_dir, **options)
        self.threads = options.get("threads") or 1

    async def cpu_report(self) -> CpuReport:
        """For the split of its node's cores (cluster/cores.py); its threads stay as built."""
        return cpu_report(self.threads, engine=self)

    async def load_weights(self, named_tensors, version: int) -> int:
        """``AsyncRolloutEngine.load_weights``, also from :class:`HeldWeights`."""
        if isinstance(named_tensors, HeldWeights):
            named_tensors = await named_tensors.holder.held_weights.remote(named_tensors.version)
        return await super().load_weights(named_tensors, version)

    async def restart(self, store: StoreConfig, run: str, agent: str, version: int, after: list | None = None,
                      **options) -> bool:
        """Serve a stored version as a new engine with these arguments would (``RolloutEngine.restart``)."""
        if after:
            await asyncio.gather(*after)
        model_dir, adapter_dir = engine_dirs(ExperienceStore(store), run, agent, version)
        return await super().restart(model_dir, version, adapter_dir=adapter_dir, **options)


def engine_dirs(store: ExperienceStore, run: str, agent: str, version: int) -> tuple[str, str | None]:
    """What an engine loads for a stored version: its directory, or for LoRA adapters (policy/lora.py) the
    agent's base (version 0, which retention keeps) and the adapters' directory. Told by the checkpoint's
    contents, so an engine serves whatever the version is."""
    directory = store.require_policy(run, agent, version)  # fetched into this node's cache from an S3 store
    if is_adapter_checkpoint(directory):
        return str(store.require_policy(run, agent, 0)), str(directory)
    return str(directory), None
