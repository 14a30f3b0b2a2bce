"""An agent's trainer in its engine's process (``agents.<a>.hybrid``), as verl's hybrid engine holds its actor and
its rollout in one worker.

Why: start-up is CPU-bound on a small machine, and a trainer process of its own pays torch's and transformers' imports
that its engine's process has already paid for vLLM. One process per agent saves them. The cost: the engine's and the
trainer's Python share one interpreter lock. Where every core is busy anyway (the demo: two agents on two cores) what
the engines gain the trainers lose, and the steps do not change; a trainer with a core to spare beside its engine loses
much of its rate to the lock (bench/pipeline/one_process.py). So it is a choice per agent, not the default.

The actor (:class:`AgentProcess`) is replica 0 of the agent's engines with a ``StoreTrainer`` beside the engine.
Ray runs an asynchronous actor's calls out of order (a call whose arguments arrive first starts first), and a
trainer's calls must run in the order they were issued. So each trainer call carries its turn, numbered by the
driver's handle (:class:`InProcessTrainer`, the trainer actor's interface), and waits for it; it then runs on a
thread of its own lane: the training calls on one, the weight hand-overs on another (as the trainer actor's
``weights`` concurrency group), so each thread keeps its own torch thread count. The engine's calls run as before.
A new version's weights stay in the process: its engine loads them as they are, its other replicas ask for them
(:class:`HeldWeights`). The process reports its engine's CPU and its trainer's apart (the lanes' threads carry an OS
name of their own), so the trainer's threads follow its demand as a trainer actor's do (cluster/cores.py).

A replica 0 that dies takes the trainer with it: the launch fails and resumes from the newest durable version, as
when a trainer actor dies. Its replica slot restarts as a plain engine (which finds no weights held to load: the
rollout then fails saying so, if the trainer's error has not stopped the launch first). With ``ray.keep_actors`` a
clean launch keeps the process for the next one, which restarts it in place (:meth:`AgentProcess.restart`: a new
trainer, then the engine's restart), as it restarts a trainer actor and an engine (cluster/warm_actors.py).
"""

from __future__ import annotations

import asyncio
import gc
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import ray

from marl_pipeline.cluster.cores import TRAINER_THREADS, CpuReport, cpu_report, name_thread, named_threads_cpu
from marl_pipeline.cluster.engines import HeldWeights, StoreAsyncEngine
from marl_pipeline.cluster.trainers import StoreTrainer, TrainerActor
from marl_pipeline.config import StoreConfig

WEIGHTS = frozenset(name for name, member in vars(TrainerActor).items()
                    if getattr(member, "__ray_concurrency_group__", None) == "weights")
"""The trainer's calls that run on the weights lane: those of the trainer actor's ``weights`` group."""
CONCURRENCY_GROUPS = {"train": 1000, "weights": 1000}
"""Ray's groups for the two lanes' calls. Above any number of calls outstanding: a call waiting for its turn holds
a slot, and the call whose turn it is must find one."""


class _Lane:
    """One thread running a trainer's calls in turn order."""

    def __init__(self, name: str) -> None:
        self.thread = ThreadPoolExecutor(1, thread_name_prefix=f"trainer-{name}", initializer=name_thread,
                                         initargs=(TRAINER_THREADS,))
        self.next = 0
        self.turn: asyncio.Condition | None = None  # made in the lane's Ray event loop, on its first call

    async def call(self, turn: int, function, *args, **kwargs):
        self.turn = self.turn or asyncio.Condition()
        async with self.turn:
            await self.turn.wait_for(lambda: self.next == turn)
        try:
            return await asyncio.get_running_loop().run_in_executor(self.thread, partial(function, *args, **kwargs))
        finally:
            async with self.turn:
                self.next += 1
                self.turn.notify_all()


class AgentProcess(StoreAsyncEngine):
    """An agent's engine (replica 0) and trainer in one process."""

    def __init__(self, store: StoreConfig, run: str, agent: str, version: int, trainer: dict, **options) -> None:
        """``trainer``: the trainer actor's keyword arguments (``prepare`` included: version 0 is made here first,
        then served); ``options``: the engine actor's."""
        self._lanes = {"train": _Lane("train"), "weights": _Lane("weights")}
        # Built on the training lane's thread, whose torch thread count it sets for its calls.
        self.trainer = self._lanes["train"].thread.submit(
            lambda: StoreTrainer(store, run, agent, version, **trainer)).result()
        super().__init__(store, run, agent, version, **options)
        self._held: dict[int, list] = {}  # version -> its weights, from the trainer's named_weights

    async def restart(self, store: StoreConfig, run: str, agent: str, version: int, trainer: dict,
                      **options) -> bool:
        """Become the process ``__init__`` with these arguments builds (a kept process taken by a new launch,
        cluster/warm_actors.py): a new trainer on the training lane, built as a new process builds it, version 0 made
        first if asked; then the engine's restart (``StoreAsyncEngine.restart``: the new version's weights, or a new
        engine in place), whose answer is this one's. The lanes count the new launch's turns from 0."""
        self._held, self.trainer = {}, None
        gc.collect()  # the last launch's weights and AdamW moments, before the new trainer loads its own
        for lane in self._lanes.values():
            lane.next = 0
        self.trainer = await asyncio.get_running_loop().run_in_executor(
            self._lanes["train"].thread, lambda: StoreTrainer(store, run, agent, version, **trainer))
        return await super().restart(store, run, agent, version, **options)

    async def cpu_report(self) -> CpuReport:
        """The engine's part of the process (cluster/cores.py): its CPU less the trainer's threads'."""
        return cpu_report(self.threads, time.process_time() - named_threads_cpu(TRAINER_THREADS), engine=self)

    async def trainer_cpu_report(self) -> CpuReport:
        """The trainer's part: the lanes' threads and those they started, by their OS name."""
        return cpu_report(self.trainer.num_threads, named_threads_cpu(TRAINER_THREADS))

    @ray.method(concurrency_group="train")
    async def train_call(self, turn: int, method: str, *args, **kwargs):
        if method != "named_weights":
            return await self._lanes["train"].call(turn, getattr(self.trainer, method), *args, **kwargs)
        # Kept here for the engine beside it, which loads them as they are: through the object store they were
        # serialized into it and copied out again, in this same process.
        version, weights = await self._lanes["train"].call(
            turn, lambda: (self.trainer.version, self.trainer.named_weights()))
        self._held[version] = weights
        context = ray.get_runtime_context()
        return HeldWeights(context.current_actor, context.get_actor_id(), version)

    @ray.method(concurrency_group="weights")
    async def weights_call(self, turn: int, method: str, *args, **kwargs):
        return await self._lanes["weights"].call(turn, getattr(self.trainer, method), *args, **kwargs)

    async def held_weights(self, version: int) -> list:
        """A held version's weights, for another replica of the agent (through the object store)."""
        if version not in self._held:
            raise ValueError(f"version {version} is no longer held here (held: {sorted(self._held)})")
        return self._held[version]

    async def load_weights(self, named_tensors, version: int) -> int:
        """Serve a version; those held here as they are. The older ones held are let go: the replicas sync in version
        order, and a restart that asks for a version let go is given the newer one (inference/replicas.py)."""
        here = ray.get_runtime_context().get_actor_id()
        if isinstance(named_tensors, HeldWeights) and named_tensors.holder_id == here:
            held = named_tensors.version
            named_tensors = await self.held_weights(held)
            self._held = {v: weights for v, weights in self._held.items() if v >= held}
        return await super().load_weights(named_tensors, version)


def remote_agent_process():
    """``ray.remote`` of :class:`AgentProcess`, with its lanes' concurrency groups."""
    return ray.remote(concurrency_groups=CONCURRENCY_GROUPS)(AgentProcess)


class InProcessTrainer:
    """The driver's handle to the trainer of an :class:`AgentProcess`, with a trainer actor's interface:
    ``trainer.accumulate.remote(batch)`` returns an ``ObjectRef``. Each call is numbered in its lane as it is issued,
    under a lock, so the actor runs them in that order. Not to be passed to other processes (the numbering is here).
    ``cpu_report`` is answered at once, beside the lanes (cluster/cores.py)."""

    reports_cpu = True

    def __init__(self, actor) -> None:
        self.actor = actor
        self._turns = {"train": 0, "weights": 0}
        self._lock = threading.Lock()

    def __getattr__(self, method: str) -> _RemoteMethod:
        if method.startswith("_"):
            raise AttributeError(method)
        if method == "cpu_report":
            return self.actor.trainer_cpu_report
        return _RemoteMethod(self, method)

    def submit(self, method: str, args: tuple, kwargs: dict) -> ray.ObjectRef:
        lane = "weights" if method in WEIGHTS else "train"
        with self._lock:
            ref = getattr(self.actor, f"{lane}_call").remote(self._turns[lane], method, *args, **kwargs)
            self._turns[lane] += 1  # only once submitted: a call that failed to go leaves no gap
        return ref


class _RemoteMethod:
    def __init__(self, trainer: InProcessTrainer, method: str) -> None:
        self.trainer, self.method = trainer, method

    def remote(self, *args, **kwargs) -> ray.ObjectRef:
        return self.trainer.submit(self.method, args, kwargs)
