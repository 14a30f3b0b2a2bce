"""What the calibration run's processes measured of their own CPU, against which the driver is charged
(planner/costs.py). Each version's ``timing.json`` holds, so far in the launch: the driver's CPU seconds and its
rollout messages (streaming calls sent to replicas, chunks of results back), and the agent's engine replicas' and
trainer's CPU seconds (cluster/cores.py's ``cpu_seconds``; runs stored before 2026-11-29 have the driver's only).

Over a launch's steps the driver's CPU followed its messages more than its turns, and two replicas split each wave
into two calls and each engine step's results into two chunks: a step is charged per turn and per message, and an
agent's turns send the calibration's messages per turn and replica times its replicas (docs/ARCHITECTURE.md).
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np


def nonnegative_fit(x: np.ndarray, y: np.ndarray) -> list[float]:
    """Least squares with every coefficient at least 0 (a negative cost is a fit artefact): the columns whose
    coefficient came out negative are dropped and the rest fitted again."""
    keep = list(range(x.shape[1]))
    while True:
        coef, *_ = np.linalg.lstsq(x[:, keep], y, rcond=None)
        if (coef >= 0).all() or len(keep) == 1:
            full = [0.0] * x.shape[1]
            for index, value in zip(keep, coef):
                full[index] = max(float(value), 0.0)
            return full
        keep = [index for index, value in zip(keep, coef) if value >= 0] or keep[:1]


def driver_rates(rollouts, timings: dict[tuple, dict], replicas: float = 1.0) -> dict[str, float]:
    """``driver_per_turn``, ``driver_per_message`` and ``messages_per_turn`` from each agent's versions'
    ``timing.json`` records (the driver's CPU seconds and rollout messages so far): between consecutive records,
    CPU = a x turns + b x messages, fitted (least squares, both at least 0); messages per turn over the run, per
    replica (``replicas``: the run's, a mean over its agents); each the median over agents. Records without messages
    (older runs), or fewer than four: all the CPU per turn."""
    steps = set(rollouts.column("step").to_pylist())
    turns_per_step = max(rollouts.num_rows / max(len(steps), 1), 1.0)
    records: dict[str, list[tuple]] = defaultdict(list)
    for (agent, _), record in timings.items():
        if record.get("driver_cpu_seconds") is not None:
            records[agent].append((record["step"], record["driver_cpu_seconds"], record.get("driver_messages")))
    rates = []
    for marks in records.values():
        marks = np.array(sorted(marks), dtype=float)  # a missing count is nan
        if len(marks) < 2 or marks[-1, 0] <= marks[0, 0]:
            continue
        if np.isnan(marks[:, 2]).any() or len(marks) < 4:
            rates.append(((marks[-1, 1] - marks[0, 1]) / (marks[-1, 0] - marks[0, 0]) / turns_per_step, 0.0, 0.0))
            continue
        steps_between, cpu, messages = np.diff(marks, axis=0).T
        a, b = nonnegative_fit(np.stack([steps_between * turns_per_step, messages], axis=1), cpu)
        rates.append((a, b, messages.sum() / (steps_between.sum() * turns_per_step * replicas)))
    per_turn, per_message, messages_per_turn = np.median(rates, axis=0) if rates else (0.0, 0.0, 0.0)
    return {"driver_per_turn": float(per_turn), "driver_per_message": float(per_message),
            "messages_per_turn": float(messages_per_turn)}
