"""What the processes' CPU counters recorded with each policy version (``timing.json``) tell the calibration: the
driver's CPU per turn and its cores on average (``driver_cpu_seconds``), and a trainer's CPU a step beyond its calls
(``process_cpu_seconds``): the step's end in its process (the weights handed to the engines, the version saved),
which no stored span times and the simulation would otherwise not charge."""

from __future__ import annotations

from collections import defaultdict
from itertools import pairwise

import numpy as np


def driver_per_turn(rollouts, timings: dict[tuple, dict]) -> float:
    """The driver's CPU seconds between an agent's first and last recorded versions (each ``timing.json`` holds the
    driver's CPU seconds so far, ``driver_cpu_seconds``) over the turns of the steps between them; the median over
    agents (0 where none has two records)."""
    steps = set(rollouts.column("step").to_pylist())
    turns_per_step = rollouts.num_rows / max(len(steps), 1)
    records: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for (agent, _), record in timings.items():
        if record.get("driver_cpu_seconds") is not None:
            records[agent].append((record["step"], record["driver_cpu_seconds"]))
    rates = []
    for marks in records.values():
        (first, before), (last, after) = min(marks), max(marks)
        if last > first:
            rates.append((after - before) / (last - first) / max(turns_per_step, 1.0))
    return float(np.median(rates)) if rates else 0.0


def driver_cores(timings: dict[tuple, dict]) -> float:
    """The cores the driver kept busy on average between the first and last recorded versions (0: not recorded)."""
    marks = sorted((record["ended"], record["driver_cpu_seconds"]) for record in timings.values()
                   if record.get("driver_cpu_seconds") is not None)
    if len(marks) < 2 or marks[-1][0] <= marks[0][0]:
        return 0.0
    return max(marks[-1][1] - marks[0][1], 0.0) / (marks[-1][0] - marks[0][0])


def trainer_step_end(records: list[dict], charged: dict[int, float]) -> float:
    """A trainer's CPU seconds a step beyond what its calls are charged: between two recorded versions, its process's
    CPU (``process_cpu_seconds``, read as the optimizer step ends) less ``charged`` (step -> the core-seconds the
    simulation charges the agent's calls of that step), per step; the median over consecutive records, at least 0
    (0 where fewer than two record it: versions stored before 2026-11-27)."""
    marks = sorted((record["step"], record["process_cpu_seconds"]) for record in records
                   if record.get("process_cpu_seconds"))
    rates = [max(after - before - sum(charged.get(step, 0.0) for step in range(first + 1, last + 1)), 0.0)
             / (last - first) for (first, before), (last, after) in pairwise(marks) if last > first]
    return float(np.median(rates)) if rates else 0.0
