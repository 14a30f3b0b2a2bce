"""``plan_capacity``: one experiment planned on a described cluster with costs from stored runs, what both ``marl plan``
and the ``capacity_plan`` asset show, with the same options."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from marl_pipeline.config import ExperimentConfig
from marl_pipeline.planner.plan import (
    calibration,
    calibration_error,
    describe_nodes,
    gpu_costs_for,
    planned_nodes,
    predict,
    this_machine,
)
from marl_pipeline.store import ExperienceStore


def plan_capacity(config: ExperimentConfig, data: dict[str, Any], store: ExperienceStore, runs: str | list[str], *,
                  cluster: str | None = None, steps: int | None = None, gpu: str | None = None,
                  profile: str | None = None, threads_profile: str | None = None,
                  engine_profiles: dict[str, str] | None = None, by_length: bool = False,
                  search: bool = False) -> dict[str, Any]:
    """The experiment ``config`` (made from the mapping ``data``, which the search varies) planned and simulated.

    Args:
        store, runs: the stored run (or runs, each figure their mean) whose timings give the costs, taken to have
            run on this machine.
        cluster: ``NODESxCPUS[:GPUS]``; None: the Ray cluster at ``ray.address`` (or ``RAY_ADDRESS``), else this
            machine's CPUs.
        steps: steps to simulate (None: the experiment's).
        gpu, profile, engine_profiles: GPUs of this kind, the trainers' MFU from ``bench/engines/gpu_trainer.py
            --rl``'s output, agents' engines from measured profiles (planner/plan.py's ``gpu_costs_for``).
        threads_profile: what a trainer's threads buy on these CPUs (planner/threads.py), in place of linear.
        by_length: with ``gpu``, each agent's engine parallelism and trainer workers by range of context length.
        search: try allocations and list the best few with the settings that make each.

    Returns:
        A JSON-able summary: step seconds, steps an hour, each step's seconds, busy shares, the bound, staleness,
        the placement, the costs' source, the nodes, the simulation's assumptions, ``calibration_error`` (each
        calibration run simulated again against its measured step time: how far to trust the prediction);
        ``by_length`` and ``search`` when asked.

    Raises:
        ValueError: a bad option, a run without a recorded launch, costs without an agent's figures.
        PlacementError: the plan does not fit.
    """
    from marl_pipeline.planner.search import search as search_allocations
    from marl_pipeline.planner.threads import thread_profile

    if by_length and gpu is None:
        raise ValueError("planning by context length needs a GPU kind: the ranges come from a GPU's memory")
    nodes = planned_nodes(cluster, config.ray.address)
    threads = thread_profile(threads_profile) if threads_profile else None
    stored = calibration(store, runs, this_machine(), threads)

    def costs_for(candidate: ExperimentConfig):
        return stored if gpu is None else gpu_costs_for(candidate, gpu, stored, profile, engine_profiles)

    runs = [runs] if isinstance(runs, str) else list(runs)
    checked = calibration_error(store, runs, this_machine(), stored)  # where the runs ran, as calibrated
    costs = costs_for(config)
    placement, prediction = predict(config, nodes, costs, steps)
    summary: dict[str, Any] = {
        "step_seconds": prediction.mean_step_seconds, "steps_per_hour": prediction.steps_per_hour,
        "per_step": prediction.step_seconds, "busy": prediction.busy, "bound": prediction.bound,
        "staleness": prediction.staleness, "placement": placement.summary(), "costs": costs.source,
        "nodes": describe_nodes(nodes), "assumptions": list(prediction.assumptions), "calibration_error": checked}
    if by_length:
        summary["by_length"] = needs_by_length(config, gpu)
    if search:
        summary["search"] = [{"settings": c.settings(), "step_seconds": c.step_seconds,
                              "steps_per_hour": c.steps_per_hour, "bound": c.bound}
                             for c in search_allocations(data, nodes, costs_for, steps)]
    return summary


def needs_by_length(config: ExperimentConfig, gpu_name: str) -> dict[str, dict]:
    """Each agent's needs by range of context length (planner/selector.py), and the ``parallelism_by_length`` entries
    a run applies between steps: its episodes in flight on one replica (``engine.max_outstanding``, else its share of
    a micro-batch's episodes) at each range's longest context."""
    from marl_pipeline.planner.profiles import gpu as gpu_spec
    from marl_pipeline.planner.selector import describe, layout_entries, parallelism_by_length

    card, found = gpu_spec(gpu_name), {}
    episodes = config.pipeline.prompts_per_micro_batch * config.pipeline.samples_per_prompt
    for agent, settings in config.agents.items():
        model = json.loads((Path(settings.model) / "config.json").read_text())
        sequences = settings.engine.max_outstanding or -(-episodes // settings.engine.replicas)
        ranges = parallelism_by_length(model, card, sequences)
        found[agent] = {"ranges": describe(ranges), "parallelism_by_length": layout_entries(ranges)}
    return found
