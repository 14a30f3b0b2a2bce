"""An agent's engine and trainer sharing its GPUs and taking turns (``agents.<a>.colocated``): FlexMARL's
agent-centric allocation, what verl's hybrid engine and OpenRLHF's colocated mode do for one policy.

Placement: one placement group per such agent, G one-GPU bundles on one node (``STRICT_PACK``), G being its
``trainer.workers`` and its engine's ``tensor_parallel_size``. Trainer rank k reserves half of bundle k's GPU; the
engine half of bundle 0's, or, split over G GPUs, its vLLM workers half of each (vLLM's ``VLLM_RAY_PER_WORKER_GPUS``
and ``VLLM_RAY_BUNDLE_INDICES``, which OpenRLHF sets the same way). Ray then shows engine rank k and trainer rank k
the same GPU. The halves are Ray's bookkeeping: the memory is shared by taking turns.

Turns, with ``pipeline.mode: synchronous`` (a whole step's rollout, then its training; the config refuses
streaming): before the agent's first training call of a step its engine sleeps (vLLM's sleep level 1 on a GPU:
KV cache freed, weights to host memory; on a CPU level 0, its scheduler paused) and its trainer moves its state
back onto the GPUs; after the step's optimizer step, weight export and checkpoint, the trainer moves its weights,
gradients and AdamW state to host memory, and the engine wakes as the new weights load
(``AsyncRolloutEngine.load_weights``). Actor calls run in the order they are issued, so no wait is added beyond
the engine's sleep.
"""

from __future__ import annotations

import ray
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from marl_pipeline.cluster.placement import bundle
from marl_pipeline.cluster.trainers import StoreTrainer, remote_trainer
from marl_pipeline.config import AgentConfig, ExperimentConfig, StoreConfig
from marl_pipeline.inference.engine import ENGINE_ENV

SHARE = 0.5
"""Of each shared GPU, what the engine's rank and the trainer's rank on it reserve."""


def shares_gpus(agent: AgentConfig) -> bool:
    """Whether the agent's engine and trainer share GPUs (colocated with GPUs; without, they only take turns)."""
    return agent.colocated and agent.engine.num_gpus > 0


def colocation_group(agent: AgentConfig, engine_resources: dict[str, float],
                     trainer_resources: dict[str, float]) -> PlacementGroup:
    """The agent's placement group: one GPU per trainer rank, the engine actor's CPUs beside rank 0's."""
    engine, trainer = agent.engine, agent.trainer
    first = {name: engine_resources.get(name, 0.0) + trainer_resources.get(name, 0.0)
             for name in {**engine_resources, **trainer_resources}}
    bundles = [bundle(engine.num_cpus + trainer.num_cpus, 1.0, first)]
    bundles += [bundle(trainer.num_cpus, 1.0, trainer_resources)] * (trainer.workers - 1)
    return ray.util.placement_group(bundles, strategy="STRICT_PACK")


def engine_options(agent: AgentConfig, group: PlacementGroup) -> dict:
    """The engine actor's Ray options in the agent's group: half of bundle 0's GPU, or none of its own when its vLLM
    workers (children placed in the group) take half of each bundle's."""
    engine = agent.engine
    split = engine.tensor_parallel_size > 1
    env = dict(ENGINE_ENV)
    if split:
        env |= {"VLLM_RAY_PER_WORKER_GPUS": str(SHARE),
                "VLLM_RAY_BUNDLE_INDICES": ",".join(str(k) for k in range(engine.tensor_parallel_size))}
    return dict(num_cpus=engine.num_cpus, num_gpus=0 if split else SHARE, runtime_env={"env_vars": env},
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    group, placement_group_bundle_index=0, placement_group_capture_child_tasks=split))


def trainer_options(agent: AgentConfig, group: PlacementGroup, rank: int) -> dict:
    """Trainer rank ``rank``'s Ray options in the agent's group: half of bundle ``rank``'s GPU."""
    return dict(num_cpus=agent.trainer.num_cpus, num_gpus=SHARE,
                scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=rank))


def spawn_engine(actor, agent: AgentConfig, group: PlacementGroup, store: StoreConfig, run: str, name: str,
                 options: dict, replica: int, version: int, after: list | None = None):
    """The agent's engine in its group (``actor``: the engine's Ray actor class), as spawn.py starts a replica."""
    return actor.options(**engine_options(agent, group)).remote(store, run, name, version, after=after, **options)


def release_engine(handle, keep: bool) -> None:
    """Never kept for the next launch: it holds a share of its agent's GPUs, which go with the run's group."""
    ray.kill(handle)


def start_trainer(agent: AgentConfig, group: PlacementGroup, store: StoreConfig, run: str, name: str, version: int,
                  **options):
    """The agent's trainer on one worker, in its group (never kept, as its engine)."""
    return remote_trainer(StoreTrainer).options(**trainer_options(agent, group, 0)).remote(store, run, name, version,
                                                                                            **options)


class Turns:
    """The orchestrator's side: the calls that hand a colocated agent's GPUs from its engine to its trainer and
    back (nothing for the other agents)."""

    def __init__(self, config: ExperimentConfig, engines: dict, trainers: dict) -> None:
        self.agents = {name for name, agent in config.agents.items() if agent.colocated}
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

    def last_turn(self, agent: str) -> tuple[float, float] | None:
        """When a colocated agent's engine last slept and woke (its GPUs lent to the trainer for the version just
        served), as its policy's timing record keeps it; None for the other agents."""
        if agent not in self.agents:
            return None
        turns = ray.get(self.engines[agent].primary().turns.remote())
        return turns[-1] if turns else None
