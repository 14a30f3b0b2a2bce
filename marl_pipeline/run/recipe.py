"""A training launch, top to bottom: plan from the store, set up, stream the steps, clean up.

Ray must already be initialised by the caller (the Dagster Ray resource, a test fixture or a script).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import ray

from marl_pipeline.bootstrap.policies import prepare_base_policies
from marl_pipeline.bootstrap.reward_model import prepare_reward_model
from marl_pipeline.cluster.placement import plan_placement
from marl_pipeline.cluster.spawn import start_workers
from marl_pipeline.config import ExperimentConfig
from marl_pipeline.environment import build_environment
from marl_pipeline.run.events import LaunchEvent, RunFinished, RunStarted, SetupPhase
from marl_pipeline.run.launches import finish_launch, plan_launch
from marl_pipeline.run.orchestrator import Orchestrator
from marl_pipeline.stages.execution import action_pool_settings
from marl_pipeline.store import ExperienceStore


def train(config: ExperimentConfig) -> Iterator[LaunchEvent]:
    """Run one launch: resume an unfinished one, or add ``pipeline.steps`` steps after the newest policies."""
    started = phase = time.perf_counter()
    launched = time.time()

    def done(name: str) -> SetupPhase:
        nonlocal phase
        now = time.perf_counter()
        event, phase = SetupPhase(name, now - phase), now
        return event

    # Before any work (a warm-up takes minutes): a run the cluster cannot hold fails now, with the arithmetic.
    placement = plan_placement(config, [node["Resources"] for node in ray.nodes() if node["Alive"]])
    config = placement.fitted(config)
    env = build_environment(config.environment.name, config.environment.options)
    store = ExperienceStore(config.store)
    yield done(f"placement planned, environment {config.environment.name!r} built")
    # In-process, only what is missing: a Ray task's fresh worker re-imports torch and transformers, 10-30 s a launch
    # in the suite (docs/ARCHITECTURE.md); the base_policies asset runs the same code on Ray.
    base_policies = prepare_base_policies(config, env, store)
    created = [policy.agent for policy in base_policies if policy.created]
    yield done(f"version 0 prepared for {', '.join(created)}" if created else "version 0 found in the store")
    reward_model = prepare_reward_model(config, env, store)  # after the policies: the built-in shares their tokenizer
    if reward_model is not None:
        yield done("reward model ready")
    plan = plan_launch(store, config)
    if plan.resumed:  # what the launch that died left half-written (older than this launch: none of its own)
        if removed := store.vacuum(older_than=time.time() - launched, run=config.run):
            yield done(f"removed {len(removed)} uncommitted leftovers of the launch that died")
    workers = start_workers(config, store, plan.versions, reward_model,
                            action_pool_settings(env, config.environment.pool))
    replicas = sum(agent.engine.replicas for agent in config.agents.values())
    yield done(f"engines ({replicas} replicas) and trainers of {len(config.agents)} agents started")
    finished = False
    try:
        yield RunStarted(config.run, plan, base_policies, time.perf_counter() - started, placement)
        streaming_started = time.time()
        yield from Orchestrator(config, env, store, workers, plan).run()
        finish_launch(store, config.run, plan.last_step)
        finished = True
        yield RunFinished(config.run, plan, streaming_started, time.time(), placement)
    finally:
        # Only a launch that ended cleanly leaves actors for the next (a failed one may hold a broken actor).
        workers.shutdown(keep=finished and config.ray.keep_actors)
