"""An agent's engine and trainer handing its GPUs over to each other (``agents.<a>.colocated``): FlexMARL's
agent-centric allocation, what verl's hybrid engine and OpenRLHF's colocated mode do for one policy.

Placement (the specs' ``colocation_group``, cluster/specs.py): one placement group per such agent, G one-GPU bundles
on one node (``STRICT_PACK``), G being its ``trainer.workers`` and its engine's ``tensor_parallel_size``. Trainer rank
k reserves half of bundle k's GPU; the engine half of bundle 0's, or, split over G GPUs, its vLLM workers half of
each (vLLM's ``VLLM_RAY_PER_WORKER_GPUS`` and ``VLLM_RAY_BUNDLE_INDICES``, which OpenRLHF sets the same way). Ray
then shows engine rank k and trainer rank k the same GPU. The halves are Ray's bookkeeping: the memory is shared by
handing it over.

Hand-overs, with ``pipeline.mode: synchronous`` (a whole step's rollout, then its training; the config refuses
streaming): before the agent's first training call of a step its engine sleeps (vLLM's sleep level 1 on a GPU:
KV cache freed, weights to host memory; on a CPU level 0, its scheduler paused) and its trainer moves its state
back onto the GPUs; after the step's optimizer step, weight export and checkpoint, the trainer moves its weights,
gradients and AdamW state to host memory, and the engine wakes as the new weights load
(``AsyncRolloutEngine.load_weights``). Actor calls run in the order they are issued, so no wait is added beyond
the engine's sleep.
"""

from __future__ import annotations

from collections.abc import Iterable

import ray


class GpuHandover:
    """The orchestrator's side: the calls that hand a colocated agent's GPUs from its engine to its trainer and
    back (nothing for the other agents)."""

    def __init__(self, agents: Iterable[str], engines: dict, trainers: dict) -> None:
        """``agents``: those whose engine and trainer take turns (the placement plan's ``handovers``)."""
        self.agents = set(agents)
        self.engines, self.trainers = engines, trainers
        for agent in self.agents:  # the engines sample first
            trainers[agent].offload.remote()

    def to_trainer(self, agents: list[str]) -> None:
        """Before these agents' first training call of a step (their rollout of it done): the colocated ones' engines
        sleep, and their trainers' state goes back onto the GPUs, ahead of the training calls issued next."""
        colocated = [agent for agent in agents if agent in self.agents]
        ray.get([handle.sleep.remote() for agent in colocated for handle in self.engines[agent].handles()])
        for agent in colocated:
            self.trainers[agent].onload.remote()

    def to_engine(self, agent: str) -> None:
        """After the agent's step end is issued (optimizer step, weight export, checkpoint): its trainer's state goes
        to host memory once they ran; the engine wakes as it loads the new weights."""
        if agent in self.agents:
            self.trainers[agent].offload.remote()

    def last(self, agent: str) -> tuple[float, float] | None:
        """When a colocated agent's engine last slept and woke (its GPUs lent to the trainer for the version just
        served), as its policy's timing record keeps it; None for the other agents."""
        if agent not in self.agents:
            return None
        handovers = ray.get(self.engines[agent].primary().handovers.remote())
        return handovers[-1] if handovers else None
