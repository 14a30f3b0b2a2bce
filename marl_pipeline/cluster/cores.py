"""The split of a node's cores between the engines and trainers that compute at the same time, following their
measured demand (streaming only: in ``synchronous`` mode each kind has the cores to itself, placement.py).

At each step's end every engine and resident trainer reports its process's CPU seconds (``cpu_report``): over the
step since the last report, the cores it kept busy. A trainer's threads then become its share of its node's cores
in proportion to the cores the actors on that node used, rounded to the nearest, at least 1 and at most the node's
cores. A trainer that computes while its engine mostly waits thus gets the cores its engine leaves, and actors all
busy at once keep one each. Cores used, not the share of its threads' time: a trainer given more threads is busy a
smaller share of a shorter step, so a split by that share takes them back the step after, and oscillates.

Engines keep the threads they were built with: vLLM's CPU attention checks at every step that its thread count is
the one it was built with (inference/async_engine.py), so only trainers move; the cores an engine uses still count.
Trainers with ``threads`` set, on GPUs, on several workers or swapped are left as they are. A hybrid agent's process
(cluster/hybrid.py) reports its engine and its trainer apart: the trainer's threads carry an OS name of their own
(``TRAINER_THREADS``), which the threads they start (OpenMP's) inherit.
"""

from __future__ import annotations

import ctypes
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import ray

from marl_pipeline.cluster.specs import engine_names, trainer_name

if TYPE_CHECKING:
    from marl_pipeline.cluster.placement import PlacementPlan

REPORT_TIMEOUT_S = 10.0
"""How long a step's end waits for the reports (each is answered at once, unless the actor hangs)."""


IDLE_CORES = 0.1
"""Below this many cores used on a node in all, its actors are taken as idle, and none moves."""


@dataclass(frozen=True)
class CpuReport:
    """What an actor reports of its process: where it runs, when, its CPU seconds so far and its threads; an
    engine also its vLLM steps so far and the sequences they held (the planner sets them beside its own)."""

    node: str
    pid: int
    seconds: float
    cpu_seconds: float
    threads: int
    engine_steps: int | None = None
    step_sequences: int | None = None


def cpu_report(threads: int, cpu_seconds: float | None = None, engine=None) -> CpuReport:
    """This process's report, from an actor computing on ``threads`` threads; ``cpu_seconds``: its part of the
    process's CPU seconds (a hybrid agent's engine or trainer), else all of them; ``engine``: the
    ``AsyncRolloutEngine`` whose steps it reports."""
    node = ray.get_runtime_context().get_node_id()
    steps = (None, None) if engine is None else (engine.steps, engine.step_sequences)
    return CpuReport(node, os.getpid(), time.monotonic(),
                     time.process_time() if cpu_seconds is None else cpu_seconds, threads, *steps)


TRAINER_THREADS = "marl-trainer"
"""The OS name of a hybrid agent's trainer threads (at most 15 characters: Linux keeps no more)."""


def name_thread(name: str) -> None:
    """Name this OS thread (Linux ``prctl(PR_SET_NAME)``; elsewhere nothing); the threads it starts inherit it."""
    if sys.platform == "linux":
        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)


def named_threads_cpu(name: str) -> float:
    """CPU seconds (user + system) of this process's threads that carry the OS name ``name`` (0 off Linux)."""
    total = 0
    for stat in Path("/proc/self/task").glob("*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # the thread ended meanwhile
            continue
        if text[text.index("(") + 1 : text.rindex(")")] == name:
            fields = text.rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def reports_cpu(handle) -> bool:
    """Whether the handle answers ``cpu_report``: an actor's, or a hybrid agent's trainer in its engine's process."""
    return isinstance(handle, ray.actor.ActorHandle) or getattr(type(handle), "reports_cpu", False)


def cpu_seconds(engines: list, trainer) -> dict[str, float | int | None]:
    """The CPU seconds so far of this process (the driver), of an agent's engine replicas' processes (summed) and of
    its trainer's (a hybrid agent's: each its part), from which the planner fits their charge (planner/costs.py),
    and the engines' vLLM steps so far and the sequences they held (summed); None for actors that do not answer
    (dead, hanging, or not reporting: a swapped trainer's worker)."""
    def reported(handles: list) -> list[CpuReport] | None:
        if not all(reports_cpu(handle) for handle in handles):
            return None
        try:
            return ray.get([handle.cpu_report.remote() for handle in handles], timeout=REPORT_TIMEOUT_S)
        except (ray.exceptions.RayError, AttributeError):
            return None

    def total(reports: list[CpuReport] | None, field: str) -> float | int | None:
        values = None if reports is None else [getattr(report, field) for report in reports]
        return None if values is None or None in values else sum(values)

    engine_reports, trainer_reports = reported(engines), reported([trainer])
    return {"driver_cpu_seconds": time.process_time(), "engine_cpu_seconds": total(engine_reports, "cpu_seconds"),
            "trainer_cpu_seconds": total(trainer_reports, "cpu_seconds"),
            "engine_steps": total(engine_reports, "engine_steps"),
            "engine_step_sequences": total(engine_reports, "step_sequences")}


def cores_used(before: CpuReport, after: CpuReport) -> float | None:
    """The cores the actor's process kept busy between two reports, on average: its CPU seconds over the seconds
    (None: another process, as a restarted actor, or no time between them)."""
    elapsed = after.seconds - before.seconds
    if after.pid != before.pid or elapsed <= 0:
        return None
    return max(0.0, (after.cpu_seconds - before.cpu_seconds) / elapsed)


def demand_threads(used: dict[str, float], cores: float) -> dict[str, int]:
    """Threads for each actor on one node: its share of the node's ``cores`` in proportion to the cores it used
    (``used``) among the actors', rounded to the nearest, at least 1 and at most ``cores``; nothing when they were
    idle (``IDLE_CORES``: their shares would be noise)."""
    total = sum(used.values())
    if total < IDLE_CORES:
        return {}
    return {name: int(max(1, min(cores, int(cores * share / total + 0.5)))) for name, share in used.items()}


class CoreSplit:
    """The run's side: asks its actors for reports at each step's end and moves trainers' threads."""

    def __init__(self, actors: dict, movable: set[str], node_cpus: dict[str, float],
                 engines: dict | None = None) -> None:
        """``actors``: name -> handle (each with ``cpu_report`` and, if in ``movable``, ``set_threads``); ``engines``:
        each agent's ``EngineReplicas``, whose replicas report too (read at each step: a dead one is restarted)."""
        self.actors, self.movable, self.node_cpus, self.engines = actors, movable, node_cpus, engines or {}
        self._last: dict[str, CpuReport] = {}
        self._set: dict[str, tuple[int, int]] = {}  # trainer -> (its pid, the threads last set): the call may wait

    @classmethod
    def for_run(cls, plan: PlacementPlan, engines: dict, trainers: dict) -> CoreSplit:
        """Over the run's engine replicas and trainers (actors, or in a hybrid agent's process; a swapped trainer's
        worker does not report), moving the trainers the plan lets it move (none in ``synchronous`` mode)."""
        reporting = {trainer_name(agent): handle for agent, handle in trainers.items() if reports_cpu(handle)}
        movable = {name for name in plan.movable_trainers if name in reporting}
        nodes = {node["NodeID"]: node["Resources"].get("CPU", 1.0) for node in ray.nodes() if node["Alive"]}
        split = cls(reporting, movable, nodes, engines if movable else None)
        split.after_step()  # the reports the first step is measured from
        return split

    def after_step(self) -> tuple[dict[str, tuple[int, int]], dict[str, float]]:
        """Ask every actor for its report and give each movable trainer its share of its node's cores by the cores
        used since the previous call (the first call only takes the reports). -> ({trainer: (threads before, after)}
        for those that changed, {actor: cores used})."""
        if not self.movable:
            return {}, {}
        replicas = {agent: engines.handles() for agent, engines in self.engines.items()}
        actors = self.actors | {name: handle for agent, handles in replicas.items()
                                for name, handle in zip(engine_names(agent, len(handles)), handles)}
        try:  # answered at once: a trainer reports from a thread of its own, beside its calls
            reports = dict(zip(actors, ray.get([handle.cpu_report.remote() for handle in actors.values()],
                                               timeout=REPORT_TIMEOUT_S)))
        except ray.exceptions.RayError:  # an actor died or hangs: its restart or the run's failure tells
            return {}, {}
        used = {name: cores for name, report in reports.items()
                if name in self._last and (cores := cores_used(self._last[name], report)) is not None}
        self._last = reports
        changed = {}
        for node in {report.node for report in reports.values()}:
            here = {name: cores for name, cores in used.items() if reports[name].node == node}
            for name, threads in demand_threads(here, self.node_cpus.get(node, 1.0)).items():
                if name not in self.movable:
                    continue
                report = reports[name]
                pid, current = self._set.get(name, (report.pid, report.threads))
                if pid != report.pid:  # restarted since the last move: as it reports
                    current = report.threads
                if threads != current:
                    self.actors[name].set_threads.remote(threads)  # after the calls already issued to it
                    self._set[name] = (report.pid, threads)
                    changed[name] = (current, threads)
        return changed, used
