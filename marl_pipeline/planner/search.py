"""``marl plan --search``: allocations tried by simulation, best first by steps an hour.

A local search, not an enumeration: from the experiment as written, each round tries every single change (one
agent's engine replicas or tensor parallelism up or down, its trainer workers up or down, the staleness bound up or
down, micro-batches per step doubled or halved) and moves to the best one that fits the cluster and shortens the
step, until none does. The product of every agent's choices grows as the power of the agents; one change at a time
grows with their sum, and the pipeline's step time is close to separable in them (each agent's engine and trainer
are its own actors). Each plan that does not fit is refused by the placement plan, as a launch would be.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from marl_pipeline.cluster.placement import PlacementError
from marl_pipeline.config import ConfigError, ExperimentConfig, apply_overrides, parse_config
from marl_pipeline.planner.costs import Costs
from marl_pipeline.planner.plan import predict

ROUNDS = 8
"""At most this many moves: each is a round of simulations, one per single change."""


@dataclass(frozen=True)
class Candidate:
    """One allocation tried: the overrides that make it from the experiment, and its predicted step."""

    overrides: dict
    step_seconds: float
    bound: str

    @property
    def steps_per_hour(self) -> float:
        return 3600.0 / self.step_seconds

    def settings(self) -> list[str]:
        """The overrides as ``marl train --set`` settings."""
        return [f"{key}={value}" for key, value in _dotted(self.overrides)]


def _dotted(tree: dict, prefix: str = "") -> list[tuple[str, object]]:
    items = []
    for key, value in tree.items():
        if isinstance(value, dict):
            items += _dotted(value, f"{prefix}{key}.")
        else:
            items.append((f"{prefix}{key}", value))
    return items


def _changes(config: ExperimentConfig, gpus: bool) -> list[dict]:
    """Every single change from ``config``, as overrides."""
    changes = []
    pipeline = config.pipeline
    for staleness in (pipeline.staleness - 1, pipeline.staleness + 1):
        if staleness >= 0 and pipeline.mode == "streaming":
            changes.append({"pipeline": {"staleness": staleness}})
    prompts_per_step = pipeline.prompts_per_micro_batch * pipeline.micro_batches_per_step
    for micro_batches in (pipeline.micro_batches_per_step // 2, pipeline.micro_batches_per_step * 2):
        if micro_batches >= 1 and prompts_per_step % micro_batches == 0:  # the same prompts a step, cut otherwise
            prompts = prompts_per_step // micro_batches
            changes.append({"pipeline": {"micro_batches_per_step": micro_batches, "prompts_per_micro_batch": prompts}})
    for agent, settings in config.agents.items():
        engine, trainer = settings.engine, settings.trainer
        for replicas in (engine.replicas - 1, engine.replicas + 1):
            if replicas >= 1:
                changes.append({"agents": {agent: {"engine": {"replicas": replicas}}}})
        if gpus and not settings.colocated:
            for tp in (engine.tensor_parallel_size // 2, engine.tensor_parallel_size * 2):
                if tp >= 1 and tp != engine.tensor_parallel_size:
                    changes.append({"agents": {agent: {"engine": {"tensor_parallel_size": tp, "num_gpus": tp}}}})
            for workers in (trainer.workers // 2, trainer.workers * 2):
                if workers >= 1 and workers != trainer.workers:
                    changes.append({"agents": {agent: {"trainer": {"workers": workers}}}})
    return changes


def _merge(base: dict, change: dict) -> dict:
    merged = dict(base)
    for key, value in change.items():
        merged[key] = _merge(merged.get(key, {}), value) if isinstance(value, dict) else value
    return merged


def search(data: dict, nodes: list[dict[str, float]], costs_for: Callable[[ExperimentConfig], Costs],
           steps: int | None = None, keep: int = 5) -> list[Candidate]:
    """The best ``keep`` allocations found from experiment ``data`` (its file's mapping) on ``nodes``, best first;
    ``costs_for`` gives the costs of a candidate (calibrated ones are the same for all; a roofline's depend on the
    tensor parallelism and workers).

    Raises:
        PlacementError: the experiment as written does not fit.
    """
    gpus = any(node.get("GPU", 0) for node in nodes)
    tried: dict[str, Candidate] = {}

    def attempt(overrides: dict) -> Candidate | None:
        key = repr(sorted(_dotted(overrides)))
        if key not in tried:
            try:
                config = parse_config(apply_overrides(data, overrides))
                _, prediction = predict(config, nodes, costs_for(config), steps)
            except (PlacementError, ConfigError):
                return None
            tried[key] = Candidate(overrides, prediction.mean_step_seconds, prediction.bound)
        return tried[key]

    current = attempt({})
    if current is None:
        config = parse_config(data)
        predict(config, nodes, costs_for(config), steps)  # raises the placement's arithmetic
        raise AssertionError("unreachable: the experiment fits but could not be simulated")
    for _ in range(ROUNDS):
        config = parse_config(apply_overrides(data, current.overrides))
        moves = [c for change in _changes(config, gpus)
                 if (c := attempt(_merge(current.overrides, change))) is not None]
        best = min(moves, key=lambda c: c.step_seconds, default=None)
        if best is None or best.step_seconds >= current.step_seconds:
            break
        current = best
    return sorted(tried.values(), key=lambda c: c.step_seconds)[:keep]
