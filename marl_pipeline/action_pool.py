"""An action-level pool of CPU workers (Ray actors): one action at a time per worker, never one per trajectory.

Every action of a micro-batch is queued at once, cheapest expected cost first (short actions do not
wait behind long ones; the mean completion time is the smallest for a known cost order). Each
worker runs one action at a time. The pool grows from ``min_workers`` towards ``max_workers`` while
the queue is long (one worker per ``actions_per_worker`` queued or running actions) and shrinks back
when workers sit idle.

Faults are per action and never block the others:

- an action that raises is a recorded failure (deterministic: not retried);
- an action past ``timeout_s`` is abandoned by its worker (which answers at once and keeps serving)
  and retried up to ``retries`` times, then recorded as ``timeout``; a worker that stops answering
  is killed and replaced (the only way to stop a running actor call);
- a worker whose resident memory passes ``memory_bytes`` after an action is recycled, the action
  recorded as ``memory_limit``; a worker that dies is replaced and its action retried.
"""

from __future__ import annotations

import heapq
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import ray
from pydantic import BaseModel, ConfigDict, Field

OutcomeStatus = Literal["ok", "failed", "timeout", "memory_limit"]


class PoolSettings(BaseModel):
    """Pool size, limits and retries (an environment's options may carry one)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    min_workers: int = Field(1, ge=1)
    """Workers kept alive while the pool exists."""
    max_workers: int = Field(4, ge=1)
    """Most workers at once, reached when the queue is long."""
    actions_per_worker: int = Field(4, ge=1)
    """Queued or running actions per worker the pool aims for when it sizes itself."""
    timeout_s: float = Field(30.0, gt=0)
    """Per-action wall-clock limit; the worker running it is killed when it passes."""
    retries: int = Field(1, ge=0)
    """Extra attempts for an action that timed out or whose worker died (not for one that raised)."""
    memory_bytes: int = Field(2 * 2**30, gt=0)
    """A worker above this resident memory after an action is recycled."""
    num_cpus: float = Field(0.25, ge=0)
    """Ray CPUs reserved per worker."""
    max_abandoned: int = Field(2, ge=1)
    """A worker holding this many abandoned (timed-out) action threads is recycled."""
    kill_grace_s: float = Field(5.0, ge=0)
    """A worker that has not answered ``timeout_s + kill_grace_s`` after an action started is killed."""


@dataclass(frozen=True)
class Job:
    """One action to run: ``fn(*args)`` on a worker; produced by the environment stage, consumed by the pool."""

    fn: Callable[..., Any]
    args: tuple
    expected_cost: float = 1.0


@dataclass(frozen=True)
class ActionOutcome:
    """What became of one job: produced by the pool, consumed by the environment stage and benchmarks."""

    status: OutcomeStatus
    value: Any
    error: str | None
    attempts: int
    finished: float
    """time.monotonic() when the outcome was recorded."""


class ActionWorker:
    """A plain worker; ``ray.remote`` is applied by the pool with resources from its settings.

    The action runs on a daemon thread joined with the timeout: a stuck action is abandoned there and
    the worker answers at once, so a timeout costs no actor restart. The pool recycles a worker that
    holds ``max_abandoned`` abandoned threads, and kills one that does not answer at all (a backstop).
    """

    def __init__(self) -> None:
        self.abandoned = 0

    def run(self, fn: Callable[..., Any], args: tuple, timeout_s: float) -> tuple[str, Any, int, int]:
        import psutil

        box: list = []

        def target() -> None:
            try:
                box.append(("ok", fn(*args)))
            except Exception as exc:  # the action's own failure is its result
                box.append(("failed", f"{type(exc).__name__}: {exc}"))

        thread = threading.Thread(target=target, daemon=True)
        thread.start()
        thread.join(timeout_s)
        if thread.is_alive():
            self.abandoned += 1
            status, value = "timeout", f"action exceeded timeout_s={timeout_s}"
        else:
            status, value = box[0]
        return status, value, psutil.Process().memory_info().rss, self.abandoned

    def ready(self) -> bool:
        return True


@dataclass(eq=False)
class _Worker:
    handle: Any
    spawned: float
    started: Any = None
    """The ``ready`` call's ref: a worker takes actions once it has answered (start-up is not action time)."""


class ActionPool:
    """Runs jobs on an elastic set of worker actors; see the module docstring for the policy."""

    def __init__(self, settings: PoolSettings = PoolSettings()) -> None:
        if settings.max_workers < settings.min_workers:
            raise ValueError(f"max_workers ({settings.max_workers}) < min_workers ({settings.min_workers})")
        self.settings = settings
        self._actor = ray.remote(ActionWorker).options(num_cpus=settings.num_cpus, max_concurrency=1)
        self._idle: list[_Worker] = []
        self._starting: list[_Worker] = []
        self._lifetimes: list[tuple[float, float]] = []  # (spawned, retired) of every retired worker
        self.peak_workers = 0
        self._lock = threading.Lock()  # environment-stage threads share one pool: one map at a time
        for _ in range(settings.min_workers):
            self._spawn()

    # -- public -----------------------------------------------------------------------------------
    def map(self, jobs: Sequence[Job]) -> list[ActionOutcome]:
        """Run every job; returns one outcome per job, in order. Never raises for a job's failure."""
        with self._lock:
            return self._map(jobs)

    def _map(self, jobs: Sequence[Job]) -> list[ActionOutcome]:
        s = self.settings
        queue = [(job.expected_cost, i, 0) for i, job in enumerate(jobs)]
        heapq.heapify(queue)
        running: dict[ray.ObjectRef, tuple[_Worker, int, int, float]] = {}
        outcomes: list[ActionOutcome | None] = [None] * len(jobs)
        while queue or running:
            self._resize(len(queue) + len(running), busy=len(running))
            while queue and self._idle:
                _, index, attempt = heapq.heappop(queue)
                worker = self._idle.pop()
                ref = worker.handle.run.remote(jobs[index].fn, jobs[index].args, s.timeout_s)
                running[ref] = (worker, index, attempt, time.monotonic())
            wait = 0.05
            if running:
                oldest = min(started for *_, started in running.values())
                wait = min(wait, oldest + s.timeout_s + s.kill_grace_s - time.monotonic())
            starting = {w.started: w for w in self._starting}
            ready, _ = ray.wait([*running, *starting], num_returns=1, timeout=max(0.0, wait))
            for ref in ready:
                if ref in starting:
                    self._starting.remove(starting[ref])
                    self._idle.append(starting[ref])
                    continue
                worker, index, attempt, _ = running.pop(ref)
                try:
                    status, value, rss, abandoned = ray.get(ref)
                except ray.exceptions.RayActorError as exc:  # the worker died under the action
                    self._retire(worker)
                    self._retry_or_record(queue, outcomes, jobs, index, attempt, "failed", f"worker died: {exc}")
                    continue
                if rss > s.memory_bytes:
                    self._retire(worker)
                    outcomes[index] = ActionOutcome("memory_limit", None, f"worker resident memory {rss} bytes "
                                                    f"> memory_bytes {s.memory_bytes}", attempt + 1, time.monotonic())
                    continue
                if abandoned >= s.max_abandoned:
                    self._retire(worker)  # stuck threads hold its memory and CPU: start a fresh one
                else:
                    self._idle.append(worker)
                if status == "timeout":
                    self._retry_or_record(queue, outcomes, jobs, index, attempt, "timeout", value)
                    continue
                outcomes[index] = ActionOutcome(status, value if status == "ok" else None,
                                                None if status == "ok" else value, attempt + 1, time.monotonic())
            now = time.monotonic()
            for ref, (worker, index, attempt, started) in list(running.items()):
                if now - started >= s.timeout_s + s.kill_grace_s:
                    del running[ref]
                    self._retire(worker)  # an unresponsive worker: killing the actor is what stops it
                    self._retry_or_record(queue, outcomes, jobs, index, attempt, "timeout",
                                          f"worker unresponsive {s.timeout_s + s.kill_grace_s:.1f} s into the action")
        self._resize(0, busy=0)
        return outcomes  # type: ignore[return-value]

    def wait_ready(self) -> None:
        """Block until every starting worker has answered (warm the pool before timing it)."""
        ray.get([w.started for w in self._starting])
        self._idle += self._starting
        self._starting.clear()

    def worker_seconds(self, since: float = 0.0) -> float:
        """Worker lifetime (spawn request to kill) summed over every worker, counted from ``since`` (monotonic)."""
        now = time.monotonic()
        spans = self._lifetimes + [(w.spawned, now) for w in [*self._idle, *self._starting]]
        return sum(max(0.0, end - max(start, since)) for start, end in spans)

    def shutdown(self) -> None:
        for worker in [*self._idle, *self._starting]:
            self._retire(worker)

    # -- internals --------------------------------------------------------------------------------
    def _retry_or_record(self, queue: list, outcomes: list, jobs: Sequence[Job], index: int, attempt: int,
                         status: OutcomeStatus, error: str) -> None:
        if attempt < self.settings.retries:
            heapq.heappush(queue, (jobs[index].expected_cost, index, attempt + 1))
        else:
            outcomes[index] = ActionOutcome(status, None, f"{error} (after {attempt + 1} attempts)", attempt + 1,
                                            time.monotonic())

    def _resize(self, pending: int, busy: int) -> None:
        """Grow towards one worker per ``actions_per_worker`` pending actions; drop idle workers above that."""
        s = self.settings
        target = min(s.max_workers, max(s.min_workers, math.ceil(pending / s.actions_per_worker)))
        while busy + len(self._starting) + len(self._idle) < target:
            self._spawn()
        while self._idle and busy + len(self._starting) + len(self._idle) > target:
            self._retire(self._idle[0])
        self.peak_workers = max(self.peak_workers, busy + len(self._starting) + len(self._idle))

    def _spawn(self) -> None:
        handle = self._actor.remote()
        self._starting.append(_Worker(handle, time.monotonic(), handle.ready.remote()))

    def _retire(self, worker: _Worker) -> None:
        for group in (self._idle, self._starting):
            if worker in group:
                group.remove(worker)
        ray.kill(worker.handle)
        self._lifetimes.append((worker.spawned, time.monotonic()))


_shared: dict[tuple[str, PoolSettings], ActionPool] = {}


def shared_pool(settings: PoolSettings) -> ActionPool:
    """One pool per settings and Ray session in this process (the environment stage's, when a plugin asks)."""
    key = (ray.get_runtime_context().get_job_id(), settings)  # a new ray.init must not reuse dead actors
    if key not in _shared:
        _shared[key] = ActionPool(settings)
    return _shared[key]
