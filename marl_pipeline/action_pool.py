"""An action-level pool of CPU workers (Ray actors): one action at a time per worker, never one per trajectory.

Every action of a micro-batch is queued at once, cheapest expected cost first (short actions do not
wait behind long ones; the mean completion time is the smallest for a known cost order). Each
worker runs one action at a time. The pool grows from ``min_workers`` towards ``max_workers`` while
the queue is long (one worker per ``actions_per_worker`` queued or running actions) and shrinks back
as it drains: a worker idle for more than ``idle_grace_s`` is retired, down to ``min_workers``. Jobs
come in batches (``map``) or one at a time (``submit``, as each trajectory reaches its next action).

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
import itertools
import math
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
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
    spare_workers: int = Field(0, ge=0)
    """Idle workers kept ready beyond what the queue needs (up to ``max_workers``), so that an action arriving
    while the others are busy does not wait for a worker to start."""
    max_starting: int = Field(1, ge=1)
    """Workers the pool starts at once when it grows (a start costs a CPU for a while; meanwhile the queue drains
    to warm workers, which often makes the next start unnecessary)."""
    idle_grace_s: float = Field(0.5, ge=0)
    """A worker idle this long while the pool is above ``min_workers`` (and above what the queue needs) is retired."""


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
    idle_since: float = 0.0
    """time.monotonic() when it last became idle (it is retired after ``idle_grace_s`` idle above ``min_workers``)."""


class ActionPool:
    """Runs jobs on an elastic set of worker actors; see the module docstring for the policy.

    A dispatcher thread owns the queue and the workers: ``submit`` queues one job and returns a future
    (trajectories can feed the pool one action at a time, as they reach it); ``map`` submits a batch
    and waits for all of it. Every caller shares one cost-ordered queue.
    """

    def __init__(self, settings: PoolSettings = PoolSettings()) -> None:
        if settings.max_workers < settings.min_workers:
            raise ValueError(f"max_workers ({settings.max_workers}) < min_workers ({settings.min_workers})")
        self.settings = settings
        self._actor = ray.remote(ActionWorker).options(num_cpus=settings.num_cpus, max_concurrency=1)
        self._idle: list[_Worker] = []
        self._starting: list[_Worker] = []
        self._lifetimes: list[tuple[float, float]] = []  # (spawned, retired) of every retired worker
        self.peak_workers = 0
        self._lock = threading.RLock()  # guards the queue and the worker lists
        self._wake = threading.Condition(self._lock)
        self._queue: list[tuple[float, int, int, Job, Future]] = []  # (cost, sequence, attempt, job, future)
        self._sequence = itertools.count()
        self._running: dict[ray.ObjectRef, tuple[_Worker, int, Job, Future, float]] = {}
        self._done: list[ray.ObjectRef] = []  # refs Ray reported ready, for the dispatcher
        self._closed = False
        with self._lock:
            for _ in range(settings.min_workers):
                self._spawn()
        self._thread = threading.Thread(target=self._dispatch_loop, name="action-pool", daemon=True)
        self._thread.start()

    # -- public -----------------------------------------------------------------------------------
    def submit(self, job: Job) -> Future:
        """Queue one job; the future's result is its :class:`ActionOutcome` (never an exception)."""
        future: Future = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("the pool is shut down")
            heapq.heappush(self._queue, (job.expected_cost, next(self._sequence), 0, job, future))
            self._assign()  # an idle worker takes it at once
            self._wake.notify()
        return future

    def map(self, jobs: Sequence[Job]) -> list[ActionOutcome]:
        """Run every job; returns one outcome per job, in order. Never raises for a job's failure."""
        with self._lock:  # queue the whole batch at once, so its cost order holds
            futures = [self.submit(job) for job in jobs]
        return [future.result() for future in futures]

    def wait_ready(self) -> None:
        """Block until every starting worker has answered (warm the pool before timing it)."""
        with self._lock:
            refs = [w.started for w in self._starting]
        ray.get(refs)
        with self._lock:
            now = time.monotonic()
            for worker in list(self._starting):
                if worker.started in refs:
                    self._starting.remove(worker)
                    worker.idle_since = now
                    self._idle.append(worker)
            self._assign()

    def live_workers(self) -> int:
        """Workers alive now: starting, idle or running an action."""
        with self._lock:
            return len(self._starting) + len(self._idle) + len(self._running)

    def worker_seconds(self, since: float = 0.0, until: float | None = None) -> float:
        """Worker lifetime (spawn request to kill) summed over every worker, counted from ``since`` to ``until``
        (monotonic; ``until`` defaults to now, for workers still alive)."""
        with self._lock:
            now = time.monotonic() if until is None else until
            alive = [w.spawned for w in [*self._idle, *self._starting]] + [r[0].spawned for r in self._running.values()]
            spans = self._lifetimes + [(spawned, now) for spawned in alive]
        return sum(max(0.0, min(end, now) - max(start, since)) for start, end in spans)

    def shutdown(self) -> None:
        with self._lock:
            self._closed = True
            self._wake.notify()
        self._thread.join(timeout=10)
        with self._lock:
            for ref, (worker, *_, future, _) in list(self._running.items()):
                del self._running[ref]
                self._retire(worker)
                if not future.done():
                    future.set_result(ActionOutcome("failed", None, "pool shut down", 1, time.monotonic()))
            while self._queue:
                *_, future = heapq.heappop(self._queue)
                future.set_result(ActionOutcome("failed", None, "pool shut down", 0, time.monotonic()))
            for worker in [*self._idle, *self._starting]:
                self._retire(worker)

    # -- dispatcher -------------------------------------------------------------------------------
    def _dispatch_loop(self) -> None:
        """Event-driven: Ray completion callbacks wake it (no polling); it also wakes for kill and retire deadlines."""
        s = self.settings
        while True:
            with self._lock:
                if self._closed:
                    return
                for ref in self._done:
                    worker = next((w for w in self._starting if w.started == ref), None)
                    if worker is not None:
                        self._starting.remove(worker)
                        worker.idle_since = time.monotonic()
                        self._idle.append(worker)
                    elif ref in self._running:
                        self._finish(ref)
                self._done.clear()
                now = time.monotonic()
                for ref, (worker, attempt, job, future, started) in list(self._running.items()):
                    if now - started >= s.timeout_s + s.kill_grace_s:
                        del self._running[ref]
                        self._retire(worker)  # an unresponsive worker: killing the actor is what stops it
                        limit = s.timeout_s + s.kill_grace_s
                        self._retry_or_record(job, future, attempt, "timeout",
                                              f"worker unresponsive {limit:.1f} s into the action")
                surplus = self._resize(now)
                self._assign()
                if self._done:
                    continue
                deadlines = [started + s.timeout_s + s.kill_grace_s for *_, started in self._running.values()]
                if surplus:  # idle workers above the target, not yet past the grace: wake to retire them
                    deadlines += [w.idle_since + s.idle_grace_s for w in self._idle]
                due = min(deadlines, default=None)
                self._wake.wait(None if due is None else max(0.001, due - time.monotonic()))

    def _watch(self, ref: ray.ObjectRef) -> None:
        """Wake the dispatcher when ``ref`` is ready (a Ray callback: no polling)."""

        def done(_: Any) -> None:
            with self._lock:
                self._done.append(ref)
                self._wake.notify()

        ref.future().add_done_callback(done)

    def _finish(self, ref: ray.ObjectRef) -> None:
        s = self.settings
        worker, attempt, job, future, _ = self._running.pop(ref)
        try:
            status, value, rss, abandoned = ray.get(ref)
        except ray.exceptions.RayActorError as exc:  # the worker died under the action
            self._retire(worker)
            self._retry_or_record(job, future, attempt, "failed", f"worker died: {exc}")
            return
        if rss > s.memory_bytes:
            self._retire(worker)
            future.set_result(ActionOutcome("memory_limit", None, f"worker resident memory {rss} bytes "
                                            f"> memory_bytes {s.memory_bytes}", attempt + 1, time.monotonic()))
            return
        if abandoned >= s.max_abandoned:
            self._retire(worker)  # stuck threads hold its memory and CPU: start a fresh one
        else:
            worker.idle_since = time.monotonic()
            self._idle.append(worker)
        if status == "timeout":
            self._retry_or_record(job, future, attempt, "timeout", value)
            return
        future.set_result(ActionOutcome(status, value if status == "ok" else None,
                                        None if status == "ok" else value, attempt + 1, time.monotonic()))

    def _assign(self) -> None:
        """Hand queued jobs, cheapest first, to idle workers (most recently idle first: the others can retire)."""
        while self._queue and self._idle:
            _, _, attempt, job, future = heapq.heappop(self._queue)
            worker = self._idle.pop()
            ref = worker.handle.run.remote(job.fn, job.args, self.settings.timeout_s)
            self._running[ref] = (worker, attempt, job, future, time.monotonic())
            self._watch(ref)

    def _retry_or_record(self, job: Job, future: Future, attempt: int, status: OutcomeStatus, error: str) -> None:
        if attempt < self.settings.retries:
            heapq.heappush(self._queue, (job.expected_cost, next(self._sequence), attempt + 1, job, future))
        else:
            future.set_result(ActionOutcome(status, None, f"{error} (after {attempt + 1} attempts)", attempt + 1,
                                            time.monotonic()))

    def _resize(self, now: float) -> bool:
        """Grow towards one worker per ``actions_per_worker`` pending actions; retire workers idle past the grace."""
        s = self.settings
        busy = len(self._running)
        pending = len(self._queue) + busy
        target = min(s.max_workers, max(s.min_workers, math.ceil(pending / s.actions_per_worker) + s.spare_workers))
        while busy + len(self._starting) + len(self._idle) < target and len(self._starting) < s.max_starting:
            self._spawn()
        # Oldest-idle first; a worker is only retired after idling idle_grace_s (bursts reuse warm ones).
        for worker in sorted(self._idle, key=lambda w: w.idle_since):
            if busy + len(self._starting) + len(self._idle) <= max(target, s.min_workers):
                break
            if now - worker.idle_since >= s.idle_grace_s:
                self._retire(worker)
        self.peak_workers = max(self.peak_workers, busy + len(self._starting) + len(self._idle))
        return bool(self._idle) and busy + len(self._starting) + len(self._idle) > max(target, s.min_workers)

    def _spawn(self) -> None:
        handle = self._actor.remote()
        worker = _Worker(handle, time.monotonic(), handle.ready.remote())
        self._starting.append(worker)
        self._watch(worker.started)

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
