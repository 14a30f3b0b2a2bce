"""A training launch, top to bottom: plan from the store, set up, stream the steps, clean up.

Ray must already be initialised by the caller (the Dagster Ray resource, a test fixture or a script).
"""

from __future__ import annotations

import time
from collections.abc import Generator, Iterator

from marl_pipeline.bootstrap.policies import BasePolicy, base_policy_makers, latest_versions, require_turn_adapters
from marl_pipeline.bootstrap.reward_model import prepare_reward_model
from marl_pipeline.cluster.cores import CoreSplit
from marl_pipeline.cluster.heap import heap_frozen
from marl_pipeline.cluster.spawn import plan_on_ray, start_workers
from marl_pipeline.config import ExperimentConfig
from marl_pipeline.environment import build_environment
from marl_pipeline.run.events import (
    CollapseStopped,
    LaunchEvent,
    LayoutChanged,
    RunFinished,
    RunStarted,
    SetupPhase,
    StepFinished,
    ThreadsChanged,
)
from marl_pipeline.run.launches import finish_launch, plan_launch
from marl_pipeline.run.layouts import describe, stored_layouts
from marl_pipeline.run.orchestrator import Orchestrator
from marl_pipeline.run.tracking import MetricsExport
from marl_pipeline.services.scheduler import connect, start_services
from marl_pipeline.stages.execution import action_pool_settings
from marl_pipeline.store import ExperienceStore


def train(config: ExperimentConfig, launch_id: str | None = None) -> Iterator[LaunchEvent]:
    """Run one launch: resume an unfinished one, or add ``pipeline.steps`` steps after the newest policies. An agent
    with ``parallelism_by_length`` starts in the layout the stored rollouts call for; where a step's rollouts call for
    another, the launch ends after that step and the next one resumes it in the new layout (run/layouts.py).

    Args:
        config: the experiment.
        launch_id: what names this launch elsewhere (the Dagster run id), kept in the run's launch record.
    """
    store = ExperienceStore(config.store)
    layouts = stored_layouts(store, config, min(latest_versions(store, config.run, list(config.agents)).values()) - 1)
    metrics = MetricsExport(config)  # before any work: a tracking URI that does not answer fails the launch now
    finished, began = False, None
    try:
        while ended := (yield from _launch(config.laid_out(layouts), launch_id, store, metrics, layouts, began)):
            step, relayout, lengths, began = ended
            yield LayoutChanged(step, {agent: (describe(config, agent, layouts.get(agent)),
                                               describe(config, agent, index)) for agent, index in relayout.items()},
                                lengths)
            layouts = {**layouts, **relayout}
        finished = True
    finally:
        metrics.close(finished)


def _launch(config: ExperimentConfig, launch_id: str | None, store: ExperienceStore, metrics: MetricsExport,
            layouts: dict[str, int | None], began: tuple | None) -> Generator[LaunchEvent, None, tuple | None]:
    """One launch in one layout. Returns None once the launch's steps are done, or, when a step's rollouts call for
    another layout, that step, the agents' new ``parallelism_by_length`` entries, their longest turns, and the plan
    and streaming start of the first launch of this call (``began``: passed on; its ``RunFinished`` reports them)."""
    started = phase = time.perf_counter()
    launched = time.time()

    def done(name: str) -> SetupPhase:
        nonlocal phase
        now = time.perf_counter()
        event, phase = SetupPhase(name, now - phase), now
        return event

    # Before any work (a warm-up takes minutes): a run the cluster cannot hold fails now, with the arithmetic.
    placement = plan_on_ray(config)  # the actors start from it and the run-time reads it; the config stays as written
    env = build_environment(config.environment.name, config.environment.options)
    yield done(f"placement planned, environment {config.environment.name!r} built")
    # What is missing of version 0 is made in the agents' trainer actors as the workers start (the base_policies
    # asset runs the same makers in Ray tasks); the built-in model they start from is built here, first.
    makers = base_policy_makers(config, env, store)
    if makers:
        yield done(f"version 0 missing for {', '.join(makers)}: made by their trainers as they start")
    reward_model = prepare_reward_model(config, env, store)  # after the built-in model: it shares its tokenizer
    if reward_model is not None:
        yield done("reward model ready")
    plan = plan_launch(store, config, launch_id, started=launched)
    if plan.resumed:  # what the launch that died left half-written (older than this launch: none of its own)
        if removed := store.vacuum(older_than=time.time() - launched, run=config.run):
            yield done(f"removed {len(removed)} uncommitted leftovers of the launch that died")
    starting = start_workers(placement, store, plan.versions, reward_model, config.reward_model,
                             action_pool_settings(env, config.environment.pool), prepare=makers)
    while True:  # each engine and trainer as it is up, its seconds counted from when the workers were asked for
        try:
            actor = next(starting)
        except StopIteration as started_all:
            workers = started_all.value
            break
        yield SetupPhase(f"{actor} up", time.perf_counter() - phase)
    replicas = sum(agent.engine.replicas for agent in config.agents.values())
    made = {policy.agent: policy for policy in workers.base_policies}
    yield done(f"engines ({replicas} replicas) and trainers of {len(config.agents)} agents started"
               + (f", version 0 made for {', '.join(made)}" if made else ""))
    clean = relaid = False
    try:
        if config.services:  # one scheduler per service for every caller of the run; this process calls them too
            workers.services = start_services(config.services)
            connect()
            yield done(f"schedulers of services {', '.join(config.services)} started")
        require_turn_adapters(config, store)
        base_policies = [made.get(agent) or BasePolicy(agent, store.policy_dir(config.run, agent, 0), created=False)
                         for agent in config.agents]
        yield RunStarted(config.run, plan, base_policies, time.perf_counter() - started, placement)
        streaming_started = time.time()
        cores = CoreSplit.for_run(placement, workers.engines, workers.trainers)
        orchestrator = Orchestrator(config, env, store, workers, plan, layouts)
        with heap_frozen():  # the start-up heap lives as long as the launch (cluster/heap.py)
            for event in orchestrator.run():
                metrics.add(event)
                yield event
                if isinstance(event, StepFinished) and (moved := cores.after_step())[0]:
                    yield ThreadsChanged(event.step, *moved)
        if relaid := bool(orchestrator.relayout):  # its record stays unfinished: the next launch resumes it
            return (orchestrator.last_step, orchestrator.relayout, orchestrator.relayout_lengths,
                    began or (plan, streaming_started))
        clean = True  # stopped on collapse, its last step is committed too: its actors are sound
        if orchestrator.collapsed:  # its record stays unfinished: a relaunch, settings changed, resumes it
            yield CollapseStopped(config.run, orchestrator.last_step, orchestrator.collapsed)
            return None
        finish_launch(store, config.run, plan.last_step)
        yield RunFinished(config.run, *(began or (plan, streaming_started)), time.time(), placement)
        return None
    finally:
        # Only a launch that ended cleanly (finished, or stopped on collapse after its step) leaves actors for the
        # next (a failed one may hold a broken actor); one ending for a new layout leaves them for the next launch of
        # this call, which takes the ones it can use.
        workers.shutdown(keep=relaid or (clean and config.ray.keep_actors))
