"""What crosses between the action pool and its workers: the job, the worker's report, the outcome.

Ray-free, so the environment stage and benchmarks can name these types without starting Ray; the
pool (``action_pool.py``) applies ``ray.remote`` to :class:`ActionWorker` with resources from its settings.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

OutcomeStatus = Literal["ok", "failed", "timeout", "memory_limit"]


@dataclass(frozen=True)
class WorkerReport:
    """One action's run on one worker: produced by :meth:`ActionWorker.run`, consumed by the pool."""

    status: Literal["ok", "failed", "timeout"]
    value: Any
    """The action's return value (``ok``), else the reason it failed."""
    rss_bytes: int
    """The worker's resident memory after the action (the pool recycles a worker above ``memory_bytes``)."""
    abandoned_threads: int
    """Timed-out action threads the worker still holds (the pool recycles it at ``max_abandoned``)."""


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
    """Attempts made (a hedged copy belongs to its attempt: it is not counted as another)."""
    finished: float
    """time.monotonic() when the outcome was recorded."""
    hedged: bool = False
    """Whether a duplicate (hedged) copy of some attempt of this job was started."""


class ActionWorker:
    """A plain worker; ``ray.remote`` is applied by the pool with resources from its settings.

    The action runs on a daemon thread joined with the timeout: a stuck action is abandoned there and
    the worker answers at once, so a timeout costs no actor restart. The pool recycles a worker that
    holds ``max_abandoned`` abandoned threads, and kills one that does not answer at all (a backstop).
    """

    def __init__(self) -> None:
        from marl_pipeline.services.scheduler import connect  # Ray's: here, in the worker's own process

        self.abandoned = 0
        connect()  # the plugin's actions may call the run's services (environment.service)

    def run(self, fn: Callable[..., Any], args: tuple, timeout_s: float) -> WorkerReport:
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
        return WorkerReport(status, value, psutil.Process().memory_info().rss, self.abandoned)

    def ready(self) -> bool:
        return True
