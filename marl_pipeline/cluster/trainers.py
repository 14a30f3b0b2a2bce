"""A run's trainer actors: a trainer that starts from a version in the store and uploads the versions it makes
(:class:`StoreTrainer`), and an agent's trainer on several workers (:class:`ShardedTrainer`, ``trainer.workers``).

A sharded trainer is one Ray actor per torch.distributed rank in a placement group (training/sharded.py is the
torch side). Rank 0 leads: the run calls it as it calls a one-worker trainer. It deals each micro-batch's rows to the
ranks by token count, makes the same call on every other rank (submitted before it computes its own share) and
merges what they return; a rank runs its calls in the order rank 0 submits them, so their collectives line up.
Rank 0 starts the other ranks itself, so they share its fate: when it is killed or dies, they stop too. Kept
between launches (``ray.keep_actors``), rank 0 is taken with its group and restarts the others: every rank rebuilt in
its process, meeting in a new process group.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from dataclasses import replace

import ray
import torch
from ray.util.placement_group import PlacementGroup

from marl_pipeline.cluster.cores import CpuReport, cpu_report
from marl_pipeline.cluster.heap import collector_paused
from marl_pipeline.cluster.options import actor_options
from marl_pipeline.cluster.specs import ActorSpec
from marl_pipeline.config import StoreConfig
from marl_pipeline.policy.transfer import SyncGroup
from marl_pipeline.store import ExperienceStore
from marl_pipeline.store.checkpoints import PolicyUpload
from marl_pipeline.training.batches import TrainBatch
from marl_pipeline.training.sharded import Rank, deal, leave, merged_stats
from marl_pipeline.training.trainer import PolicyTrainer

CONCURRENCY_GROUPS = {"weights": 1, "reports": 1}
"""A trainer actor's Ray concurrency groups: a weight broadcast runs on a thread of its own, so the next step's
training calls go on meanwhile, and so does its CPU report, answered at once whatever else it runs
(``ray.remote(concurrency_groups=...)``; Ray refuses them in ``.options``)."""


def remote_trainer(actor_class: type):
    """``ray.remote`` of a trainer class, with its concurrency groups."""
    return ray.remote(concurrency_groups=CONCURRENCY_GROUPS)(actor_class)


class TrainerActor(PolicyTrainer):
    """A policy trainer as a Ray actor (:func:`remote_trainer`): its weight broadcasts run in their own concurrency
    group, beside the training calls."""

    @ray.method(concurrency_group="reports")
    def cpu_report(self) -> CpuReport:
        """For the split of its node's cores (cluster/cores.py): answered beside the training calls."""
        return cpu_report(self.num_threads)

    def set_threads(self, threads: int) -> None:
        """Its forward and backward passes' threads from the next call on (cluster/cores.py)."""
        torch._C.set_num_threads(threads)  # torch's own: vLLM's CPU worker makes torch.set_num_threads a no-op (hybrid)
        self.num_threads = threads

    @ray.method(concurrency_group="weights")
    def weights_address(self) -> str:
        return super().weights_address()

    @ray.method(concurrency_group="weights")
    def send_weights(self, group: SyncGroup, version: int) -> int:
        return super().send_weights(group, version)

    @ray.method(concurrency_group="weights")
    def staged_weights(self, version: int) -> list:
        return super().staged_weights(version)


class StoreTrainer(TrainerActor):
    """A policy trainer that starts from a version in the store (and its KL reference, version 0), fetched on the
    node it runs on, and uploads each new version to the store from there (:meth:`save_version`)."""

    def __init__(self, store: StoreConfig, run: str, agent: str, version: int, prepare: Callable | None = None,
                 **options) -> None:
        """``prepare``: the agent's version 0 is missing; ``prepare(threads)`` makes it here first, with this
        actor's resources and device, while the engines start (bootstrap/policies.py: ``base_policy_makers``)."""
        with collector_paused():  # transformers' import, version 0's making if asked, the model's load (heap.py)
            self.prepared = None if prepare is None else prepare(options.get("num_threads"))
            self.store, self.run, self.agent = ExperienceStore(store), run, agent
            super().__init__(str(self.store.require_policy(run, agent, version)), version,
                             **with_local_base(self.store, run, agent, options))

    def base_policy(self):
        """The ``BasePolicy`` this trainer prepared (None: version 0 was already in the store)."""
        return self.prepared

    def save_version(self, version: int) -> PolicyUpload:
        """Save the version just stepped to and upload it; the driver publishes it once the engine serves it."""
        if version != self.version:
            raise ValueError(f"{self.agent}: asked to save version {version}, the trainer holds {self.version}")
        staging = self.store.staging_policy_dir(self.run, self.agent, version)
        self.save(str(staging))
        return self.store.upload_policy(staging, self.run, self.agent, version)


def with_local_base(store: ExperienceStore, run: str, agent: str, options: dict) -> dict:
    """A trainer's options (specs.py: ``trainer_options``) with the base version they name (``BASE_POLICY``: the KL
    reference, a LoRA agent's base) fetched into this node's cache, for a trainer built here (an actor on its node,
    a recomputation in the driver)."""
    return {**options, **{name: str(store.require_policy(run, agent, 0))
                          for name in ("reference_dir", "base_dir") if options.get(name) is not None}}


def _rank_actor(spec: ActorSpec, group: PlacementGroup):
    return remote_trainer(ShardedTrainer).options(**actor_options(spec, group))


class ShardedTrainer(StoreTrainer):
    """One rank of an agent's trainer on several workers; rank 0, which the run calls, makes each call on all."""

    def __init__(self, ranks: list[ActorSpec], group: PlacementGroup, store: StoreConfig, run: str, agent: str,
                 version: int, rank: Rank | None = None, prepare: Callable | None = None,
                 followers: list | None = None, **options) -> None:
        """``ranks``: the specs of the trainer's ranks (the plan's), each started in its bundle of ``group``;
        ``followers``: rank 0's other ranks, kept from a launch before, restarted instead of started."""
        prepared = None if prepare is None else prepare(options.get("num_threads"))  # before any rank loads it
        self.group, self.followers, restarted = group, [], []
        if rank is None:  # rank 0: where the ranks meet, then the others, each in its bundle
            with socket.socket() as probe:
                probe.bind(("", 0))
                rank = Rank(0, len(ranks), f"{ray.util.get_node_ip_address()}:{probe.getsockname()[1]}")
            if followers:
                self.followers = followers
                restarted = [follower.restart.remote(ranks, store, run, agent, version, rank=replace(rank, rank=k),
                                                     **options) for k, follower in enumerate(followers, 1)]
            else:
                self.followers = [_rank_actor(ranks[k], group).remote(
                    ranks, group, store, run, agent, version, rank=replace(rank, rank=k), **options)
                    for k in range(1, len(ranks))]
        super().__init__(store, run, agent, version, rank=rank, **options)  # every rank joins the group here
        ray.get(restarted)
        self.prepared = prepared

    def restart(self, ranks: list[ActorSpec], store: StoreConfig, run: str, agent: str, version: int,
                **options) -> bool:
        """Become the rank ``__init__`` builds, in this process and its bundle of the same group (a kept trainer
        taken by a new launch with as many ranks, cluster/spawn.py); rank 0 restarts the others with a new meeting
        point."""
        group, followers = self.group, self.followers
        leave()
        return super().restart(ranks, group, store, run, agent, version, followers=followers, **options)

    def _on_every_rank(self, method: str, *args, shares: list | None = None) -> list:
        """``method`` on every rank (the others' calls submitted first), each with ``args``, or rank k with
        ``shares[k]``; on a rank that leads none, the call itself."""
        per_rank = [(share,) for share in shares] if shares is not None else [args] * (len(self.followers) + 1)
        refs = [getattr(follower, method).remote(*a) for follower, a in zip(self.followers, per_rank[1:])]
        own = getattr(super(), method)(*per_rank[0])
        return [own, *ray.get(refs)]

    def accumulate(self, batch: TrainBatch) -> dict[str, float]:
        if not self.followers:  # a rank's own share
            return super().accumulate(batch)
        lengths = [len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids)]
        shares = [_rows(batch, rows, dropped=batch.dropped_rows if k == 0 else 0)
                  for k, rows in enumerate(deal(lengths, len(self.followers) + 1))]
        return merged_stats(self._on_every_rank("accumulate", shares=shares))

    def apply_step(self):
        return self._on_every_rank("apply_step")[0]

    def discard_gradients(self) -> None:
        self._on_every_rank("discard_gradients")

    def named_weights(self):
        return self._on_every_rank("named_weights")[0]

    def stage_weights(self):
        return self._on_every_rank("stage_weights")[0]  # every rank gathers; rank 0 keeps them and sends

    def save(self, directory: str) -> None:
        self._on_every_rank("save", directory)

    def offload(self) -> int:
        return sum(self._on_every_rank("offload"))

    def onload(self) -> int:
        return sum(self._on_every_rank("onload"))

    def completion_logprobs(self, *args) -> list[float]:
        return self._on_every_rank("completion_logprobs", *args)[0]


def _rows(batch: TrainBatch, rows: list[int], dropped: int) -> TrainBatch:
    """Some rows of a micro-batch, as a micro-batch of their own."""
    def pick(values: list | None) -> list | None:
        return None if values is None else [values[row] for row in rows]

    return TrainBatch(pick(batch.prompt_ids), pick(batch.response_ids), pick(batch.old_logprobs),
                      pick(batch.advantages), dropped_rows=dropped, adapters=pick(batch.adapters))
