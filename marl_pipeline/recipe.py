"""A training run, top to bottom: set up from the config, stream the steps, clean up.

Ray must already be initialised by the caller (the Dagster Ray resource, a test fixture or a script).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from marl_pipeline.config import ExperimentConfig
from marl_pipeline.environment import build_environment
from marl_pipeline.orchestrator import Event, Orchestrator
from marl_pipeline.policies import BasePolicy, latest_versions, prepare_base_policies
from marl_pipeline.store import ExperienceStore
from marl_pipeline.workers import start_workers


@dataclass(frozen=True)
class RunStarted:
    """Base policies are ready and the workers are up; the run continues from ``first_step``."""

    run: str
    first_step: int
    last_step: int
    base_policies: list[BasePolicy]
    setup_seconds: float


def train(config: ExperimentConfig) -> Iterator[RunStarted | Event]:
    """Run ``config.pipeline.steps`` RL steps, continuing from the latest committed policies."""
    import time

    started = time.perf_counter()
    env = build_environment(config.environment.name, config.environment.options)
    store = ExperienceStore(config.store)
    base_policies = prepare_base_policies(config, env, store)
    # Agents step together, so a run resumes from the newest version every agent has committed.
    first_step = min(latest_versions(store, config.run, list(config.agents)).values())
    workers = start_workers(config, store, {agent: first_step for agent in config.agents})
    try:
        yield RunStarted(config.run, first_step, first_step + config.pipeline.steps - 1, base_policies,
                         time.perf_counter() - started)
        yield from Orchestrator(config, env, store, workers, first_step).run()
    finally:
        workers.shutdown()
