"""Launch planning: which steps a launch of the train job runs, and whether it resumes a killed one.

A launch records its target (last step) in the store before any work; the record is marked finished
when the last step's policies are committed. A new launch that finds an unfinished record resumes
it: same target, every committed partition kept, only missing work done. Otherwise it is a new
launch that adds ``pipeline.steps`` steps after the newest policies (periodic retraining).

The record keeps every launch of the run (``launches``): its id (the Dagster run id, or None), when it started,
its first and last step, whether it resumed, the code's commit, whether it finished, and its experiment config
with credentials removed (``configs``, by digest: launches with one config share it). A policy version's card
(run/cards.py) names the launches that trained it from this history. A record written before the history existed
holds only ``last_step`` and ``finished``, and reads as a run with no launches recorded.
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from marl_pipeline.bootstrap.policies import latest_versions
from marl_pipeline.config import ExperimentConfig, HealthConfig
from marl_pipeline.stages.health import health_state
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


def plan_launch(store: ExperienceStore, config: ExperimentConfig, launch_id: str | None = None,
                started: float | None = None) -> LaunchPlan:
    """Decide the launch's steps from the store, and record the target before any work starts.

    Args:
        store: the run's store, which holds the launch record.
        config: the launch's experiment (recorded with its credentials removed).
        launch_id: what names the launch elsewhere (the Dagster run id); None: nothing does.
        started: when the launch started (seconds since the epoch); None: now.
    """
    versions = latest_versions(store, config.run, list(config.agents))
    first_step = min(versions.values())
    record = store.read_record(config.run, RECORD) or {}
    resumed = bool(record) and not record["finished"] and first_step <= record["last_step"]
    last_step = record["last_step"] if resumed else first_step + config.pipeline.steps - 1
    public = public_config(config)
    digest = hashlib.sha256(json.dumps(public, sort_keys=True).encode()).hexdigest()[:16]
    launch = {"id": launch_id, "started_at": _iso(time.time() if started is None else started),
              "first_step": first_step, "last_step": last_step, "resumed": resumed, "commit": code_commit(),
              "config": digest, "finished": False}
    store.write_record(config.run, RECORD, {
        **record, "last_step": last_step, "finished": False, "launches": [*record.get("launches", []), launch],
        "configs": {**record.get("configs", {}), digest: public}})
    committed = {stage: sum(1 for key in store.committed_keys(config.run, stage) if first_step <= key.step <= last_step)
                 for stage in STAGES}
    return LaunchPlan(first_step, last_step, versions, resumed, committed)


def finish_launch(store: ExperienceStore, run: str, last_step: int) -> None:
    """Mark the run's launch record finished at ``last_step``, and its newest launch with it (the history kept)."""
    record = store.read_record(run, RECORD) or {}
    launches = record.get("launches", [])
    if launches:
        launches = [*launches[:-1], {**launches[-1], "finished": True}]
    store.write_record(run, RECORD, {**record, "last_step": last_step, "finished": True, "launches": launches})


def launch_history(store: ExperienceStore, run: str) -> tuple[list[dict], dict[str, dict]]:
    """The run's launches, oldest first, and their configs by digest (both empty for a record older than them)."""
    record = store.read_record(run, RECORD) or {}
    return record.get("launches", []), record.get("configs", {})


def _iso(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, UTC).isoformat(timespec="seconds")


def code_commit() -> str | None:
    """The commit of the checkout this package runs from (``git rev-parse HEAD`` in its directory); None when it is
    not a tracked file of a git checkout (an installed wheel) or git is missing."""
    package = Path(__file__).resolve().parents[1]
    try:
        # A wheel installed in a virtual environment inside some checkout would otherwise report that checkout's HEAD.
        subprocess.run(["git", "ls-files", "--error-unmatch", "__init__.py"], cwd=package, capture_output=True,
                       check=True, timeout=10)
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=package, capture_output=True, text=True, check=True,
                              timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() or None


SECRET = "***"
"""What a secret's value becomes in a recorded config."""
_URL_CREDENTIALS = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://)[^/@\s]+@")
_SECRET_KEY = re.compile(r"(password|passwd|secret|api_?key|access_?key|token)$", re.IGNORECASE)


def redact_url(text: str) -> str:
    """``text`` with the user and password of every URL in it replaced: ``https://u:p@host`` -> ``https://***@host``."""
    return _URL_CREDENTIALS.sub(rf"\g<1>{SECRET}@", text)


def public_config(config: BaseModel) -> dict:
    """The config as JSON data without its secrets: fields it keeps out of its repr (``store.secret_access_key``)
    and keys of free-form options named as secrets (``api_key``, ``password``, ...) become ``***``, and credentials
    in any URL (``store.uri``, ``tracking.mlflow``, a plugin's option) are cut out."""
    return _redacted(config, config.model_dump(mode="json"))


def _redacted(model: Any, data: Any) -> Any:
    if isinstance(model, BaseModel) and isinstance(data, dict):
        fields = type(model).model_fields
        return {name: SECRET if name in fields and not fields[name].repr and value is not None
                else _redacted(getattr(model, name, None), value) for name, value in data.items()}
    if isinstance(data, dict):
        models = model if isinstance(model, dict) else {}
        return {key: SECRET if _SECRET_KEY.search(str(key)) and isinstance(value, str)
                else _redacted(models.get(key), value) for key, value in data.items()}
    if isinstance(data, list):
        models = list(model) if isinstance(model, list | tuple) and len(model) == len(data) else [None] * len(data)
        return [_redacted(item_model, item) for item_model, item in zip(models, data)]
    return redact_url(data) if isinstance(data, str) else data


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
    health: dict[str, list[tuple[str, int]]] = field(default_factory=dict)
    """Per agent under a collapse warning at the newest stored step: what it says and the step it started."""


def run_overview(store: ExperienceStore, run: str) -> RunOverview:
    """A run's agents and newest versions, its launch record's state, and when it last committed a version."""
    agents = store.checkpoints.agents(run)
    versions = {agent: max(store.policy_versions(run, agent), default=0) for agent in agents}
    record = store.read_record(run, RECORD)
    state = "not launched" if record is None else "finished" if record["finished"] else "unfinished"
    times = [store.checkpoints.modified(run, agent, version) for agent, version in versions.items()]
    return RunOverview(run, versions, None if record is None else record["last_step"], state,
                       max((t for t in times if t is not None), default=None),
                       health_state(store, run, launch_health_settings(record)))


def launch_health_settings(record: dict | None) -> HealthConfig:
    """The ``health`` thresholds of the run's newest launch, as recorded (the defaults for a record without them)."""
    launches, configs = (record or {}).get("launches", []), (record or {}).get("configs", {})
    config = configs.get(launches[-1].get("config"), {}) if launches else {}
    return HealthConfig.model_validate(config.get("health", {}))
