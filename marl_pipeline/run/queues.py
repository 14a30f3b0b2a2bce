"""The queues between the orchestrator's stages and what crosses them: blocking puts and gets that give up once the
run stops (a stage that failed elsewhere must not leave the others blocked for ever), a stage as the orchestrator
runs it, an agent's step from the train thread to its publisher, the step barrier of synchronous mode, the
staleness gate and the step clock. The planner's simulation (marl_pipeline/planner/) runs the same barrier, gate and
clock."""

from __future__ import annotations

import queue
import threading
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from marl_pipeline.store import MicroBatchKey

if TYPE_CHECKING:
    import pyarrow as pa
    import ray

POLL_S = 0.2
"""How often a blocked put or get looks at the stop flag."""


@dataclass(frozen=True)
class Stage:
    """One stage of the micro-batch pipeline as the orchestrator runs it: ``workers`` threads compute and
    commit ``name`` for each micro-batch key that reaches them."""

    name: str
    """The stored stage (``rollouts``, ``environment_results``, ``rewards``)."""
    compute: Callable[[MicroBatchKey], pa.Table]
    workers: int


@dataclass(frozen=True)
class PendingStep:
    """One agent's optimizer step, issued by the train thread and finished by that agent's publisher."""

    step: int
    applied: ray.ObjectRef
    """-> ``StepResult`` of the optimizer step."""
    weights: ray.ObjectRef | None
    """-> the new parameters for the engines (``ray.weight_sync: broadcast``: their layout, staged in the trainer);
    None: the engines do not load this version (``agents.<a>.sync_every``)."""
    saved: ray.ObjectRef | None
    """-> the ``PolicyUpload`` of the new version: saved and uploaded by the trainer (None: not due a checkpoint)."""
    enqueued: float
    settings: ray.ObjectRef | None = None
    """-> the trainer's ``pass_settings()`` after the agent's first step of the launch (None: told already)."""


def put_until_stopped(box: queue.Queue, item: object, stop: threading.Event) -> None:
    """``box.put(item)``, blocking until there is room or ``stop`` is set (then the item is dropped)."""
    while not stop.is_set():
        try:
            box.put(item, timeout=POLL_S)
            return
        except queue.Full:
            continue


def get_until_stopped(box: queue.Queue, stop: threading.Event):
    """``box.get()``, blocking until an item comes (returned) or ``stop`` is set (None)."""
    while not stop.is_set():
        try:
            return box.get(timeout=POLL_S)
        except queue.Empty:
            continue
    return None


def gate_open(served: dict[str, int], step: int, staleness: int | Mapping[str, int]) -> bool:
    """The staleness gate: rollout of ``step`` may start once every agent's engines serve a version v with
    ``step - v <= staleness`` (``served``: the version each agent's engines serve; ``staleness``: one bound for all,
    or each agent's, ``ExperimentConfig.staleness_bounds``)."""
    if not isinstance(staleness, Mapping):
        return min(served.values()) >= step - staleness
    return all(version >= step - staleness[agent] for agent, version in served.items())


def sync_due(version: int, every: int, last_version: int) -> bool:
    """Whether an agent's engines load its ``version``: every ``every`` versions (``agents.<a>.sync_every``) and
    the launch's last (the orchestrator adds the versions it evaluates)."""
    return version % every == 0 or version == last_version


def learners(held: Mapping[str, int], step: int) -> list[str]:
    """The agents that learn ``step``: those whose trainer holds the version the step starts from (``held``: the
    version each agent's trainer holds; after a resume, an agent already past the step does not learn it again).
    The one rule, for the orchestrator's training loop and the planner's."""
    return [agent for agent, version in held.items() if version == step]


class StepBarrier:
    """Forwards keys downstream: at once (streaming), or a whole step at a time (synchronous).

    One barrier is shared by all workers of a stage, so a step completes whichever worker finishes last.
    """

    def __init__(self, micro_batches: int, synchronous: bool) -> None:
        self.micro_batches, self.synchronous = micro_batches, synchronous
        self.lock = threading.Lock()
        self.done: dict[int, list[MicroBatchKey]] = defaultdict(list)

    def add(self, key: MicroBatchKey) -> list[MicroBatchKey]:
        if not self.synchronous:
            return [key]
        with self.lock:
            self.done[key.step].append(key)
            if len(self.done[key.step]) < self.micro_batches:
                return []
            return sorted(self.done.pop(key.step))


class StepClock:
    """A launch's step times as ``StepFinished`` reports them: each step's seconds since the previous step finished
    (the first step's: since its first rollout), and its span from its own first rollout. Given the times, not
    reading a clock: the orchestrator gives it the wall clock's, the planner's simulation its simulated ones. Callers
    that finish steps from several threads hold their own lock around it."""

    def __init__(self) -> None:
        self.started: dict[int, float] = {}
        self.last_end: float | None = None

    def start(self, step: int, now: float) -> float:
        """The step's rollout starts at ``now`` unless it started already; when it started."""
        return self.started.setdefault(step, now)

    def finish(self, step: int, now: float, fallback_start: float | None = None) -> tuple[float, float]:
        """The step finished at ``now``: its seconds since the previous step finished and its span (a step never
        started here counts from ``fallback_start``, else from ``now``)."""
        first = self.started.get(step, now if fallback_start is None else fallback_start)
        since = now - (self.last_end if self.last_end is not None else first)
        self.last_end = now
        return since, now - first


def start_threads(name: str, workers: int, target: Callable[[], None], events: queue.Queue, done: object,
                  end: Callable[[None], None] | None, consumers: int = 0) -> list[threading.Thread]:
    """``workers`` threads running ``target``, each putting its error (with a note naming the stage) and then
    ``done`` on ``events``; the last to finish calls ``end(None)`` once per consumer (end-of-stream markers)."""
    remaining, lock = [workers], threading.Lock()

    def guarded() -> None:
        try:
            target()
        except BaseException as error:  # handed to the caller's thread and re-raised there
            error.add_note(f"in the {name} stage of the marl_pipeline orchestrator")
            events.put(error)
        finally:
            with lock:
                remaining[0] -= 1
                last = remaining[0] == 0
            if last and end is not None:
                for _ in range(consumers):
                    end(None)
            events.put(done)

    threads = [threading.Thread(target=guarded, name=f"marl-{name}-{i}", daemon=True) for i in range(workers)]
    for thread in threads:
        thread.start()
    return threads
