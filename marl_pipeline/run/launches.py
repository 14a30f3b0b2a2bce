"""Launch planning: which steps a launch of the train job runs, and whether it resumes a killed one.

A launch records its target (last step) in the store before any work; the record is marked finished
when the last step's policies are committed. A new launch that finds an unfinished record resumes
it: same target, every committed partition kept, only missing work done. Otherwise it is a new
launch that adds ``pipeline.steps`` steps after the newest policies (periodic retraining).
"""

from __future__ import annotations

from dataclasses import dataclass

from marl_pipeline.bootstrap.policies import latest_versions
from marl_pipeline.config import ExperimentConfig
from marl_pipeline.store import ExperienceStore
from marl_pipeline.store.schema import STAGES


@dataclass(frozen=True)
class LaunchPlan:
    """What one launch of the train job will do."""

    first_step: int
    """The oldest step some agent still has to train (min over agents of their newest version)."""
    last_step: int
    versions: dict[str, int]
    """Each agent's newest committed policy version: its trainer and engine start from it."""
    resumed: bool
    """True when this launch continues a launch that did not finish."""
    committed: dict[str, int]
    """Stage partitions already committed within [first_step, last_step] (skipped, never redone)."""


RECORD = "launch.json"
"""In the store (the bucket of an S3 store), so a launch resumed from any machine finds it."""


def plan_launch(store: ExperienceStore, config: ExperimentConfig) -> LaunchPlan:
    """Decide the launch's steps from the store, and record the target before any work starts."""
    versions = latest_versions(store, config.run, list(config.agents))
    first_step = min(versions.values())
    record = store.read_record(config.run, RECORD)
    resumed = bool(record) and not record["finished"] and first_step <= record["last_step"]
    last_step = record["last_step"] if resumed else first_step + config.pipeline.steps - 1
    store.write_record(config.run, RECORD, {"last_step": last_step, "finished": False})
    committed = {stage: sum(1 for key in store.committed_keys(config.run, stage) if first_step <= key.step <= last_step)
                 for stage in STAGES}
    return LaunchPlan(first_step, last_step, versions, resumed, committed)


def finish_launch(store: ExperienceStore, run: str, last_step: int) -> None:
    store.write_record(run, RECORD, {"last_step": last_step, "finished": True})


@dataclass(frozen=True)
class RunOverview:
    """One run of a store as ``marl runs`` lists it."""

    run: str
    versions: dict[str, int]
    """Each agent's newest committed policy version (one per trained step; 0 is the base)."""
    target_step: int | None
    """The last step the newest launch aimed at (None: never launched)."""
    state: str
    """``finished``, ``unfinished`` (killed or still running: the next launch resumes it) or ``not launched``."""
    last_activity: float | None
    """When the newest policy version was committed (seconds since the epoch)."""


def run_overview(store: ExperienceStore, run: str) -> RunOverview:
    """A run's agents and newest versions, its launch record's state, and when it last committed a version."""
    agents = store.checkpoints.agents(run)
    versions = {agent: max(store.policy_versions(run, agent), default=0) for agent in agents}
    record = store.read_record(run, RECORD)
    state = "not launched" if record is None else "finished" if record["finished"] else "unfinished"
    times = [store.checkpoints.modified(run, agent, version) for agent, version in versions.items()]
    return RunOverview(run, versions, None if record is None else record["last_step"], state,
                       max((t for t in times if t is not None), default=None))
