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
  recorded as ``memory_limit``; a worker that dies is replaced and its action retried;
- a call that Ray itself fails (an argument that cannot be unpickled on the worker) is a recorded failure.

Hedged (speculative) execution, after Dean & Barroso, "The Tail at Scale" (off unless ``hedge_after_s``
is set): an attempt still running ``hedge_after_s`` after it started gets a duplicate copy on an idle
worker (the pool grows for it up to ``max_workers``; queued actions always take idle workers first).
The first copy to finish decides the outcome, whether it returned or raised; a copy that timed out or
whose worker died decides nothing while another copy of the attempt still runs. The losing copy's
worker is killed at once (an actor call cannot be cancelled otherwise) and counts its worker-seconds
until then; the pool replaces it if it needs the worker. A hedge is a fresh run of the same action: it
helps when the slowness belongs to the attempt (a hung tool call, a stuck sandbox), not when the action
itself is slow (then both copies are slow and the hedge costs a worker for nothing).
"""

from __future__ import annotations

import heapq
import itertools
import math
import queue
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import ray

from marl_pipeline.actions.worker import ActionOutcome, ActionWorker, Job, OutcomeStatus, WorkerReport
from marl_pipeline.config import PoolSettings


@dataclass(eq=False)
class _Task:
    """One submitted job's state: its current attempt and the refs of that attempt's running copies."""

    job: Job
    future: Future
    attempt: int = 0
    copies: list = field(default_factory=list)
    """Refs of this attempt's copies still in ``_running`` (more than one once hedged)."""
    hedges: int = 0
    """Duplicate copies started for this attempt."""
    launched: float = 0.0
    """time.monotonic() when this attempt's latest copy started."""
    hedged: bool = False
    """Whether any attempt of this job got a duplicate copy."""

    def outcome(self, status: OutcomeStatus, value: Any, error: str | None) -> ActionOutcome:
        return ActionOutcome(status, value, error, self.attempt + 1, time.monotonic(), self.hedged)


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
        if settings.hedge_after_s is not None and settings.hedge_after_s >= settings.timeout_s:
            raise ValueError(f"hedge_after_s ({settings.hedge_after_s}) >= timeout_s ({settings.timeout_s}): "
                             "no attempt would ever be hedged")
        self.settings = settings
        self._actor = ray.remote(ActionWorker).options(num_cpus=settings.num_cpus, max_concurrency=1)
        self._idle: list[_Worker] = []
        self._starting: list[_Worker] = []
        self._lifetimes: list[tuple[float, float]] = []  # (spawned, retired) of every retired worker
        self.peak_workers = 0
        self._lock = threading.RLock()  # guards the queue and the worker lists
        # Ray completion callbacks never take the lock: they run on Ray's own thread, which ray.kill (called under
        # the lock to retire a worker) waits for. They hand the ref over through a lock-free queue and an event.
        self._ready: queue.SimpleQueue[ray.ObjectRef] = queue.SimpleQueue()
        self._wake = threading.Event()  # set when there is something for the dispatcher to do
        self._queue: list[tuple[float, int, _Task]] = []  # (cost, sequence, task)
        self._sequence = itertools.count()
        self._running: dict[ray.ObjectRef, tuple[_Worker, _Task, float]] = {}  # per copy: (worker, task, started)
        self._done: list[ray.ObjectRef] = []  # ready refs the dispatcher is handling now
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
            self._enqueue(_Task(job, future))
            self._assign()  # an idle worker takes it at once
            self._wake.set()
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
            self._wake.set()
        self._thread.join(timeout=10)
        with self._lock:
            for ref, (worker, task, _) in list(self._running.items()):
                del self._running[ref]
                self._retire(worker)
                if not task.future.done():
                    task.future.set_result(task.outcome("failed", None, "pool shut down"))
            while self._queue:
                *_, task = heapq.heappop(self._queue)
                task.future.set_result(ActionOutcome("failed", None, "pool shut down", task.attempt, time.monotonic(),
                                                     task.hedged))
            for worker in [*self._idle, *self._starting]:
                self._retire(worker)

    # -- dispatcher -------------------------------------------------------------------------------
    def _dispatch_loop(self) -> None:
        """Event-driven: Ray completion callbacks wake it (no polling); it also wakes for kill, hedge and retire
        deadlines."""
        s = self.settings
        while True:
            self._wake.clear()  # before taking what is ready: a ref that comes later sets it again
            with self._lock:
                if self._closed:
                    return
                while not self._ready.empty():
                    self._done.append(self._ready.get())
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
                for ref, (worker, task, started) in list(self._running.items()):
                    if now - started >= s.timeout_s + s.kill_grace_s:
                        self._drop(ref)  # an unresponsive worker: killing the actor is what stops it
                        self._retire(worker)
                        limit = s.timeout_s + s.kill_grace_s
                        self._copy_lost(task, "timeout", f"worker unresponsive {limit:.1f} s into the action")
                hedges_due, hedge_deadlines = self._hedges(now)
                surplus = self._resize(now, len(hedges_due))
                self._assign()
                self._hedge(hedges_due)
                deadlines = [started + s.timeout_s + s.kill_grace_s for *_, started in self._running.values()]
                deadlines += hedge_deadlines  # the overdue ones wait for a worker: its start or finish wakes us
                if surplus:  # idle workers above the target, not yet past the grace: wake to retire them
                    deadlines += [w.idle_since + s.idle_grace_s for w in self._idle]
                due = min(deadlines, default=None)
            self._wake.wait(None if due is None else max(0.001, due - time.monotonic()))

    def _watch(self, ref: ray.ObjectRef) -> None:
        """Wake the dispatcher when ``ref`` is ready (a Ray callback: no polling)."""

        def done(_: Any) -> None:
            self._ready.put(ref)
            self._wake.set()

        ref.future().add_done_callback(done)

    def _finish(self, ref: ray.ObjectRef) -> None:
        s = self.settings
        worker, task, _ = self._drop(ref)
        try:
            report: WorkerReport = ray.get(ref)
        except ray.exceptions.RayActorError as exc:  # the worker died under the action
            self._retire(worker)
            self._copy_lost(task, "failed", f"worker died: {exc}")
            return
        except ray.exceptions.RayError as exc:  # the call itself failed (an argument that cannot be unpickled...):
            self._retire(worker)  # a failure of the action; the dispatcher must survive it
            if not task.future.done():
                self._decide(task, task.outcome("failed", None, f"{type(exc).__name__}: {exc}"))
            return
        status, value = report.status, report.value
        if report.rss_bytes > s.memory_bytes:
            self._retire(worker)
            if not task.future.done():  # (a late copy of a decided attempt records nothing)
                self._decide(task, task.outcome("memory_limit", None, f"worker resident memory {report.rss_bytes} "
                                                f"bytes > memory_bytes {s.memory_bytes}"))
            return
        if report.abandoned_threads >= s.max_abandoned:
            self._retire(worker)  # stuck threads hold its memory and CPU: start a fresh one
        else:
            worker.idle_since = time.monotonic()
            self._idle.append(worker)
        if status == "timeout":
            self._copy_lost(task, "timeout", value)
        elif not task.future.done():  # the first copy to return or raise decides (raising is deterministic)
            self._decide(task, task.outcome(status, value if status == "ok" else None,
                                            None if status == "ok" else value))

    def _drop(self, ref: ray.ObjectRef) -> tuple[_Worker, _Task, float]:
        """Forget one running copy; returns its ``_running`` entry."""
        entry = self._running.pop(ref)
        entry[1].copies.remove(ref)
        return entry

    def _copy_lost(self, task: _Task, status: OutcomeStatus, error: str) -> None:
        """A copy timed out or lost its worker: the attempt fails only once no other copy of it still runs."""
        if not task.copies and not task.future.done():
            self._retry_or_record(task, status, error)

    def _decide(self, task: _Task, outcome: ActionOutcome) -> None:
        """Record ``task``'s outcome and stop its other copies: a copy still running loses its worker (killed);
        one that already finished (its ref is ready, not yet handled) is left to ``_finish``, which records nothing."""
        for ref in list(task.copies):
            if ref not in self._done:
                worker, *_ = self._drop(ref)
                self._retire(worker)
        task.future.set_result(outcome)

    def _assign(self) -> None:
        """Hand queued jobs, cheapest first, to idle workers (most recently idle first: the others can retire)."""
        while self._queue and self._idle:
            *_, task = heapq.heappop(self._queue)
            task.hedges = 0
            self._launch(task)

    def _launch(self, task: _Task) -> None:
        """Start a copy of ``task``'s current attempt on the most recently idle worker."""
        worker = self._idle.pop()
        ref = worker.handle.run.remote(task.job.fn, task.job.args, self.settings.timeout_s)
        task.launched = time.monotonic()
        self._running[ref] = (worker, task, task.launched)
        task.copies.append(ref)
        self._watch(ref)

    def _hedges(self, now: float) -> tuple[list[_Task], list[float]]:
        """Attempts due for a duplicate copy now (longest overdue first), and the future hedge deadlines."""
        s = self.settings
        if s.hedge_after_s is None:
            return [], []
        tasks = {task: None for _, task, _ in self._running.values() if task.hedges < s.max_hedges}
        due = sorted((t for t in tasks if now - t.launched >= s.hedge_after_s), key=lambda t: t.launched)
        return due, [t.launched + s.hedge_after_s for t in tasks if now - t.launched < s.hedge_after_s]

    def _hedge(self, due: list[_Task]) -> None:
        """Give idle workers to overdue attempts, once the queue is empty (queued actions go first)."""
        for task in due:
            if self._queue or not self._idle:
                return
            task.hedges += 1
            task.hedged = True
            self._launch(task)

    def _enqueue(self, task: _Task) -> None:
        heapq.heappush(self._queue, (task.job.expected_cost, next(self._sequence), task))

    def _retry_or_record(self, task: _Task, status: OutcomeStatus, error: str) -> None:
        if task.attempt < self.settings.retries:
            task.attempt += 1
            self._enqueue(task)
        else:
            task.future.set_result(task.outcome(status, None, f"{error} (after {task.attempt + 1} attempts)"))

    def _resize(self, now: float, hedges_due: int = 0) -> bool:
        """Grow towards one worker per ``actions_per_worker`` pending actions, plus one per hedge due (a copy needs a
        worker of its own); retire workers idle past the grace."""
        s = self.settings
        busy = len(self._running)
        pending = len(self._queue) + busy
        wanted = math.ceil(pending / s.actions_per_worker) + s.spare_workers + hedges_due
        target = min(s.max_workers, max(s.min_workers, wanted))
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


_shared: dict[tuple[str, str, PoolSettings], ActionPool] = {}


def shared_pool(settings: PoolSettings) -> ActionPool:
    """One pool per settings and Ray session in this process (what a recomputed environment partition runs on)."""
    # A new ray.init must not reuse dead actors: job ids restart at 01000000 with every new local cluster,
    # so the key also names the driver's node, which is new with every cluster.
    context = ray.get_runtime_context()
    key = (context.get_node_id(), context.get_job_id(), settings)
    if key not in _shared:
        _shared[key] = ActionPool(settings)
    return _shared[key]
