"""A node's cores shared by the actors computing on it at once, for the simulation: each job is an amount of work
(core-seconds: seconds on one thread) done by an actor on ``threads`` threads, ``speedup`` times as fast as on one
(``threads`` unless measured, planner/threads.py); while the busy threads of the node exceed its cores, every job
slows in proportion (processor sharing, which is what the OS scheduler gives OpenMP threads beyond the cores), and
with ``crowding`` > 0 each core-second held also does less work, ``(cores / threads) ** crowding`` of it: what time
slicing more threads than cores costs on a host (switches, cold caches, late wake-ups), fitted by marl profile crowding.

Written here: simpy's resources queue jobs whole (a ``Resource`` serves one at a time, a ``Container`` holds
amounts) and none shares a capacity among running jobs at changing rates.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import simpy


def crowded(share: float, crowding: float) -> float:
    """The work a core-second does when a node's threads get ``share`` of a core each (at most 1)."""
    return min(share, 1.0) ** crowding


@dataclass
class _Job:
    work: float
    threads: int
    done: simpy.Event
    speedup: float
    rate: float = 0.0
    """Cores it holds now (its threads' share of them); its work goes ``rate x speedup / threads`` a second."""
    kind: str = ""
    efficiency: float = 1.0
    """The work a core-second held does while the node is crowded (1 while its threads fit its cores)."""

    @property
    def progress(self) -> float:
        return self.rate * self.speedup / self.threads * self.efficiency


class SharedCores:
    """``cores`` cores shared by the jobs running on them (a node's CPUs, or one GPU's streaming multiprocessors
    with ``cores=1`` and jobs of one thread); ``crowding``: the exponent of the work lost beyond the cores (0: none,
    as on a device, whose jobs queue on its streams rather than being switched)."""

    def __init__(self, env: simpy.Environment, cores: float, crowding: float = 0.0) -> None:
        self.env, self.cores, self.crowding = env, cores, crowding
        self.jobs: list[_Job] = []
        self._last = 0.0
        self._wake: simpy.Event | None = None
        self.by_kind: dict[str, float] = defaultdict(float)  # core-seconds held, by the kind each job was given
        env.process(self._run())

    @property
    def busy_core_seconds(self) -> float:
        return sum(self.by_kind.values())

    def compute(self, work: float, threads: int, kind: str = "", speedup: float | None = None) -> simpy.Event:
        """An event that fires once ``work`` core-seconds are done on ``threads`` threads, which go ``speedup``
        times as fast as one (None: ``threads``); ``kind``: what :attr:`by_kind` counts the cores they held as."""
        self._advance()
        threads = max(threads, 1)
        job = _Job(max(work, 0.0), threads, self.env.event(), threads if speedup is None else speedup, kind=kind)
        self.jobs.append(job)
        self._rerate()
        return job.done

    def _advance(self) -> None:
        """Charge the time since the last change to the running jobs, at the rates they had."""
        elapsed, self._last = self.env.now - self._last, self.env.now
        for job in self.jobs:
            job.work -= job.progress * elapsed
            self.by_kind[job.kind] += job.rate * elapsed

    def _rerate(self) -> None:
        threads = sum(job.threads for job in self.jobs)
        share = min(1.0, self.cores / threads) if threads else 1.0
        efficiency = crowded(share, self.crowding)
        for job in self.jobs:
            job.rate, job.efficiency = job.threads * share, efficiency
        if self._wake is not None and not self._wake.triggered:
            self._wake.succeed()

    def _run(self):
        while True:
            finished = [job for job in self.jobs if job.work <= 1e-12]
            if finished:
                self.jobs = [job for job in self.jobs if job.work > 1e-12]
                for job in finished:
                    job.done.succeed()
                self._rerate()
            self._wake = self.env.event()
            if not self.jobs:
                yield self._wake
            else:
                soonest = min(job.work / job.progress for job in self.jobs)
                yield self._wake | self.env.timeout(soonest)
            self._advance()


class SerialWork:
    """Work queued for one thread on shared cores, computed as it comes: a process whose threads share one
    interpreter (the driver), beside what it drives. ``busy``: told ``start()`` and ``stop()`` around each job."""

    def __init__(self, cores: SharedCores, busy=None) -> None:
        self.cores, self.busy, self.backlog = cores, busy, 0.0
        self._wake = cores.env.event()
        cores.env.process(self._run())

    def add(self, work: float) -> None:
        if work > 0:
            self.backlog += work
            if not self._wake.triggered:
                self._wake.succeed()

    def _run(self):
        while True:
            if self.backlog <= 0:
                self._wake = self.cores.env.event()
                yield self._wake
            work, self.backlog = self.backlog, 0.0
            if self.busy is not None:
                self.busy.start()
            yield self.cores.compute(work, 1, "driver")
            if self.busy is not None:
                self.busy.stop()
