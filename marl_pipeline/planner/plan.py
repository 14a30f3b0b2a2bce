"""The planner's entry points: costs from a stored run, a prediction for an experiment on a described cluster.

The calibration run is planned again as it ran (its recorded config on the same nodes), so each agent's threads
and replicas, which turn its stored seconds into costs, are the ones its actors had.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from dataclasses import replace
from datetime import datetime

from marl_pipeline.cluster.placement import PlacementPlan, plan_placement
from marl_pipeline.config import ExperimentConfig, parse_config
from marl_pipeline.planner.costs import Costs, calibrate, pooled
from marl_pipeline.planner.simulate import Prediction, simulate
from marl_pipeline.planner.threads import AgentThreads, ThreadScaling
from marl_pipeline.run.launches import launch_history
from marl_pipeline.store import ExperienceStore

CLUSTER = re.compile(r"^(?:(\d+)x)?(\d+(?:\.\d+)?)(?::(\d+))?$")


def parse_cluster(text: str) -> list[dict[str, float]]:
    """``NODESxCPUS[:GPUS]`` (``48x96:8``: 48 nodes of 96 CPUs and 8 GPUs; ``2``: one node of 2 CPUs).

    Raises:
        ValueError: the text is not of that form.
    """
    match = CLUSTER.match(text.strip())
    if match is None:
        raise ValueError(f"--cluster {text!r}: expected NODESxCPUS[:GPUS], e.g. 2 (one node of 2 CPUs) or 48x96:8")
    nodes, cpus, gpus = int(match[1] or 1), float(match[2]), float(match[3] or 0)
    return [{"CPU": cpus, "GPU": gpus} for _ in range(nodes)]


def ray_cluster_nodes(address: str | None) -> list[dict[str, float]] | None:
    """The alive nodes' resources of the Ray cluster at ``address`` (or the one this process is connected to, or
    ``RAY_ADDRESS``'s), as the placement plan reads them; None where there is none to see (no address and no Ray
    running here: the planner then takes this machine)."""
    import ray

    address = address or os.environ.get("RAY_ADDRESS")
    if not ray.is_initialized():
        if address is None:
            return None
        ray.init(address=address, include_dashboard=False, log_to_driver=False)
    return [{"CPU": 0.0, "GPU": 0.0, **node["Resources"]} for node in ray.nodes() if node["Alive"]]


def this_machine() -> list[dict[str, float]]:
    """This machine's CPUs as one node without GPUs: where a stored run is taken to have run."""
    return [{"CPU": float(os.cpu_count() or 1), "GPU": 0.0}]


def planned_nodes(cluster: str | None, address: str | None) -> list[dict[str, float]]:
    """The nodes a plan is for: ``cluster`` (:func:`parse_cluster`) when given, else the Ray cluster's it can see
    (:func:`ray_cluster_nodes`), else :func:`this_machine`."""
    return parse_cluster(cluster) if cluster else ray_cluster_nodes(address) or this_machine()


def describe_nodes(nodes: list[dict[str, float]]) -> str:
    """``2 x 96 CPU, 8 GPU + 1 x 16 CPU``: the nodes grouped by their CPUs and GPUs."""
    kinds = Counter((node.get("CPU", 0.0), node.get("GPU", 0.0)) for node in nodes)
    return " + ".join(f"{count} x {cpus:g} CPU" + (f", {gpus:g} GPU" if gpus else "")
                      for (cpus, gpus), count in kinds.items())


def agent_threads(plan: PlacementPlan) -> dict[str, AgentThreads]:
    """Each agent's engine and trainer threads and engine replicas, as the plan's specs give them."""
    result = {}
    for agent in plan.engine_sets:
        engines = plan.agent_specs(agent, "engine")
        first = engines[0].parts[0] if engines[0].parts else engines[0]
        trainer = next((spec.parts[1] if spec.parts else spec for spec in plan.agent_specs(agent, "trainer")), None)
        if trainer is None:  # swapped: the worker that serves it
            trainer = next(spec for spec in plan.specs if spec.role == "trainer-worker" and agent in spec.loads)
        result[agent] = AgentThreads(first.threads, trainer.threads, len(engines), trainer.name, trainer.gpus == 0)
    return result


def calibration(store: ExperienceStore, run: str | list[str], nodes: list[dict[str, float]],
                threads: ThreadScaling | None = None) -> Costs:
    """The costs of run ``run``'s newest launch, planned on ``nodes`` as it ran; of several runs, their mean
    (:func:`pooled`); ``threads``: what a trainer's threads buy (a measured thread profile; None: linear).

    Raises:
        ValueError: a run has no recorded launch, or nothing committed to fit from; the runs' agents differ.
    """
    if not isinstance(run, str):
        return pooled([calibration(store, one, nodes, threads) for one in run])
    launches, configs = launch_history(store, run)
    if not launches:
        raise ValueError(f"run {run!r} has no recorded launch in {store.config.uri}")
    config = parse_config(configs[launches[-1]["config"]])
    cores = nodes[0].get("CPU") if len(nodes) == 1 else None  # on several nodes: as many as asked for (stated)
    return calibrate(store, run, agent_threads(plan_placement(config, nodes)), cores, threads)


def measured_step_seconds(store: ExperienceStore, run: str, launch: dict) -> tuple[float, int, int]:
    """The mean step time of ``launch`` (a record of run ``run``'s history) over its steps after the first, as
    ``StepFinished.seconds`` reported it (each step from the previous one's end), read from the store: the
    ``step_finished`` its health rows hold, of the steps the launch finished itself. A launch stored before them
    (schema 13) ends a step where its last micro-batch of any agent was trained in the launch (the update's publish
    after it left out). With the first and last step measured.

    Raises:
        ValueError: fewer than two steps trained in the launch.
    """
    first, last = launch["first_step"], launch["last_step"]
    started = datetime.fromisoformat(launch["started_at"])  # whole seconds: before the launch's first step
    ends = {row["step"]: row["step_finished"]
            for row in store.read_stage(run, "health", columns=["step", "step_finished"]).to_pylist()
            if first <= row["step"] <= last and row["step_finished"] is not None and row["step_finished"] >= started}
    if len(ends) < 2:  # stored before step_finished
        ends = {}
        for row in store.read_stage(run, "policy_updates", columns=["step", "stage_ended"]).to_pylist():
            if first <= row["step"] <= last and row["stage_ended"] is not None and row["stage_ended"] >= started:
                ends[row["step"]] = max(ends.get(row["step"], row["stage_ended"]), row["stage_ended"])
    trained = sorted(ends)
    if len(trained) < 2:
        raise ValueError(f"run {run!r}'s newest launch trained {len(trained)} step(s): a step time needs two")
    seconds = (ends[trained[-1]] - ends[trained[0]]).total_seconds() / (len(trained) - 1)
    return seconds, trained[0], trained[-1]


def calibration_error(store: ExperienceStore, runs: list[str], nodes: list[dict[str, float]],
                      costs: Costs) -> list[dict]:
    """How far the simulation, with ``costs``, lands from the runs they were fitted from: each run's newest launch
    planned again as it ran (its recorded config on ``nodes``) and simulated over its steps, its mean step time after
    the first against the measured one. A user's first sign of how far to trust a prediction.

    Raises:
        ValueError: a run without a recorded launch, or whose newest launch trained fewer than two steps.
    """
    found = []
    for run in runs:
        launches, configs = launch_history(store, run)
        if not launches:
            raise ValueError(f"run {run!r} has no recorded launch in {store.config.uri}")
        measured, first, last = measured_step_seconds(store, run, launches[-1])
        config = parse_config(configs[launches[-1]["config"]])
        simulated = predict(config, nodes, costs, last - first + 1)[1].step_seconds[1:]
        predicted = sum(simulated) / len(simulated)
        found.append({"run": run, "predicted_s": predicted, "measured_s": measured,
                      "error": predicted / measured - 1})
    return found


def predict(config: ExperimentConfig, nodes: list[dict[str, float]], costs: Costs,
            steps: int | None = None) -> tuple[PlacementPlan, Prediction]:
    """The experiment's placement plan on ``nodes`` and its simulated steps.

    Raises:
        PlacementError: the plan does not fit (with the arithmetic).
        ValueError: the costs have no figures for some of the experiment's agents.
    """
    if missing := sorted(set(config.agents) - set(costs.engines)):
        raise ValueError(f"the costs ({costs.source}) have no figures for agents {missing}: calibrate from a run "
                         f"with the same agents ({sorted(costs.engines)} there)")
    plan = plan_placement(config, nodes)
    return plan, simulate(plan, config.pipeline, replies_capped(costs, config), nodes, steps,
                          config.staleness_bounds(), {agent: a.sync_every for agent, a in config.agents.items()})


def replies_capped(costs: Costs, config: ExperimentConfig) -> Costs:
    """The workload with no turn's reply longer than its agent's ``max_new_tokens`` (``algorithm_of``): a config
    that shortens an agent's replies shortens its turns. A longer cap than the stored run's changes nothing, as its
    replies show only where each stopped."""
    caps = {agent: config.algorithm_of(agent).max_new_tokens for agent in config.agents}
    episodes = [[replace(turn, response_tokens=min(turn.response_tokens, caps.get(turn.agent, turn.response_tokens)))
                 for turn in episode] for episode in costs.episodes]
    return replace(costs, episodes=episodes)


def gpu_costs_for(config: ExperimentConfig, gpu_name: str, workload: Costs, profile: str | None = None,
                  engine_profiles: dict[str, str] | None = None) -> Costs:
    """The experiment's costs on GPUs of ``gpu_name`` (planner/profiles.py): each agent's model shape from its
    ``config.json``, its engines' tensor parallelism and trainer workers as configured, the trainers' MFU from a
    measured ``profile`` (``bench/engines/gpu_trainer.py --rl``'s output) or the roofline's default, an agent's engine
    from its measured profile (``engine_profiles``: agent -> ``marl profile engine``'s output) or the roofline; the
    workload (episodes) and the stages around the engines and trainers from a stored run's ``workload``. The
    costs' ``source`` says which each came from.

    Raises:
        ValueError: an agent's model has no ``config.json`` to read its shape from, or the GPU, a profile or an
            agent a profile names is unknown.
    """
    from pathlib import Path

    from marl_pipeline.planner.engine_profile import engine_profile
    from marl_pipeline.planner.profiles import ModelShape, gpu, gpu_costs, trainer_profile

    engine_profiles = engine_profiles or {}
    if unknown := sorted(set(engine_profiles) - set(config.agents)):
        raise ValueError(f"engine profiles for {unknown}, which are not agents of the experiment "
                         f"({sorted(config.agents)})")
    shapes = {}
    for agent, settings in config.agents.items():
        if not (Path(settings.model) / "config.json").is_file():
            raise ValueError(f"agents.{agent}.model {settings.model!r}: a GPU plan reads the model's shape from its "
                             f"config.json, and there is none there (give a model directory)")
        shapes[agent] = ModelShape.from_config(settings.model)
    card = gpu(gpu_name)
    mfu = trainer_profile(profile) if profile else None  # as measured on its own card, over that card's stated peak
    costs = gpu_costs(shapes, card, {a: s.engine.tensor_parallel_size for a, s in config.agents.items()},
                      {a: s.trainer.workers for a, s in config.agents.items()}, workload.episodes, mfu,
                      source_note=profile or "", environment=workload.environment, reward=workload.reward,
                      rollout_overhead=workload.rollout_overhead, train_overhead=workload.train_overhead,
                      handoff=workload.handoff)
    if not engine_profiles:
        return costs
    measured = {agent: engine_profile(path) for agent, path in engine_profiles.items()}
    return replace(costs, engines={**costs.engines, **measured}, source=costs.source + "; engines of " + ", ".join(
        f"{agent} from profile {path}" for agent, path in sorted(engine_profiles.items())))
