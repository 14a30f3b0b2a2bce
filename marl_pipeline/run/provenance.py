"""Where a policy version came from, read from the store: the steps and micro-batches that trained it, its
teammates' versions at those steps, its held-out evaluation and training health, and the launches that ran those
steps (their ids, code commit and config, from the launch record: run/launches.py). Step s makes version s + 1, so
version v was trained by steps 0..v-1.

Teammates' versions come from the ``rollouts`` partitions' ``policy_version`` column: the version of each agent
that served each turn of the step, which with ``pipeline.staleness`` > 0 may be older than the step, or two
versions in one step. The ``health`` rows' ``policy_version`` is the version the step's update made (always
s + 1), not the version a teammate played with.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.dataset as ds

from marl_pipeline.config import HealthConfig
from marl_pipeline.config.algorithm import with_own_values
from marl_pipeline.run.launches import launch_history, redact_url
from marl_pipeline.stages.evaluation import stored_metrics
from marl_pipeline.stages.health import stored_collapse
from marl_pipeline.store import ExperienceStore, MicroBatchKey, StoreError

PROVENANCE_FORMAT = 3
"""The layout of ``provenance.json``; a change to its keys bumps it."""


def policy_provenance(store: ExperienceStore, run: str, agent: str, version: int) -> dict:
    """Everything the store and its launch record say about one stored policy version, as JSON data.

    Args:
        store: the experience store holding the run.
        run: the run.
        agent: the agent.
        version: a committed policy version of ``agent``.

    Returns:
        ``run``, ``agent``, ``version``; ``roles``: the roles the agent's policy played (several: a shared policy; from
        the launch's config, else the agent's own); ``base_model``: the agent's ``model`` in the config of the launch
        that made the version (None where the record holds no config); ``steps``: each step that trained it, its
        micro-batches' ``rows`` and ``tokens``, their totals, the ``teammates``' and the agent's own
        ``sampled_versions``; ``steps_missing``: steps of 0..v-1 without stored policy updates of the agent; ``rows``
        and ``tokens`` over the steps; ``evaluation``: the agent's and the team's held-out metrics at the version, and
        each role's under ``roles`` where the policy is shared (None: not evaluated); ``health``: the agent's signals of
        step v-1 (None: version 0, or not stored); ``warnings``: the agent's collapse warnings at step v-1, as the
        launch's ``health`` settings read them (None: version 0, or no health stored); ``algorithm``: the settings the
        agent trained with, ``{"settings": ..., "own": [fields the agent set itself]}`` (None where the record holds no
        config); ``launches``: those whose steps cover steps 0..v-1 (for version 0 the run's first); ``commit`` and
        ``config``: of the launch that made the version, credentials removed.

    Raises:
        StoreError: the agent has no such version in the run.
    """
    versions = store.policy_versions(run, agent)
    if version not in versions:
        raise StoreError(f"run {run!r} of {store.uri} has no version {version} of agent {agent!r} "
                         f"(versions there: {versions or 'none'}; agents: {store.checkpoints.agents(run) or 'none'})")
    steps = trained_steps(store, run, agent, version)
    launches, configs = launch_history(store, run)
    covering = covering_launches(launches, version)
    making = [launch for launch in covering if version == 0 or launch["last_step"] >= version - 1]
    made_by = making[-1] if making else None
    config = configs.get(made_by["config"]) if made_by else None
    roles = (config or {}).get("agents", {}).get(agent, {}).get("roles") or [agent]
    return {
        "format": PROVENANCE_FORMAT, "run": run, "agent": agent, "version": version, "roles": roles,
        "base_model": (config or {}).get("agents", {}).get(agent, {}).get("model"),
        "store": redact_url(store.uri),
        "steps": steps, "steps_missing": sorted(set(range(version)) - {step["step"] for step in steps}),
        "rows": sum(step["rows"] for step in steps), "tokens": sum(step["tokens"] for step in steps),
        "evaluation": version_evaluation(store, run, agent, version, roles),
        "health": step_health_row(store, run, agent, version - 1) if version else None,
        "algorithm": agent_algorithm(config, agent) if config else None,
        "warnings": version_warnings(store, run, agent, version, config),
        "launches": covering, "commit": made_by["commit"] if made_by else None, "config": config,
    }


def agent_algorithm(config: dict, agent: str) -> dict:
    """The algorithm settings ``agent`` trained with in a launch's recorded ``config``: the experiment's with the
    agent's own values over them (as ``ExperimentConfig.algorithm_of`` makes them), and which fields it set."""
    own = (config.get("agents") or {}).get(agent, {}).get("algorithm") or {}
    return {"settings": with_own_values(config.get("algorithm") or {}, own),
            "own": sorted(name for name, value in own.items() if value is not None)}


def version_warnings(store: ExperienceStore, run: str, agent: str, version: int, config: dict | None
                     ) -> list[str] | None:
    """The agent's collapse warnings at the step that made ``version`` (the warnings of the version's training, as
    the launch logged them), read with the making launch's ``health`` settings."""
    if not version or not store.is_committed("health", MicroBatchKey(run, version - 1, 0)):
        return None
    settings = HealthConfig.model_validate((config or {}).get("health") or {})
    return [warning for warning in stored_collapse(store, run, version - 1, settings)
            if warning.split(" ", 1)[0] == agent]


def trained_steps(store: ExperienceStore, run: str, agent: str, version: int) -> list[dict]:
    """Steps 0..version-1 of ``agent`` as its stored ``policy_updates`` rows give them (one row per micro-batch),
    with the versions every agent's turns were sampled at in that step's ``rollouts``."""
    if version == 0:
        return []
    before = ds.field("step") < version
    updates = store.read_stage(run, "policy_updates", columns=["step", "micro_batch", "rows", "tokens"],
                               filter=before & (ds.field("agent") == agent))
    served = served_versions(store.read_stage(run, "rollouts", columns=["step", "agent", "policy_version"],
                                              filter=before))
    steps: dict[int, dict] = {}
    for row in sorted(updates.to_pylist(), key=lambda row: (row["step"], row["micro_batch"])):
        step = steps.setdefault(row["step"], {"step": row["step"], "micro_batches": [], "rows": 0, "tokens": 0})
        step["micro_batches"].append({"micro_batch": row["micro_batch"], "rows": row["rows"], "tokens": row["tokens"]})
        step["rows"] += row["rows"]
        step["tokens"] += row["tokens"]
    for number, step in steps.items():
        at_step = served.get(number, {})
        step["teammates"] = {name: found for name, found in sorted(at_step.items()) if name != agent}
        step["sampled_versions"] = at_step.get(agent, [])
    return list(steps.values())


def served_versions(rollouts: pa.Table) -> dict[int, dict[str, list[int]]]:
    """Step -> agent -> the policy versions that served its turns, from rollouts with step, agent and
    policy_version columns."""
    distinct = rollouts.group_by(["step", "agent", "policy_version"]).aggregate([]) if rollouts.num_rows else rollouts
    found: dict[int, dict[str, list[int]]] = {}
    for row in distinct.to_pylist():
        found.setdefault(row["step"], {}).setdefault(row["agent"], []).append(row["policy_version"])
    return {step: {name: sorted(versions) for name, versions in agents.items()} for step, agents in found.items()}


def version_evaluation(store: ExperienceStore, run: str, agent: str, version: int, roles: list[str]) -> dict | None:
    """The agent's and the team's held-out metrics stored with the version's evaluation, and each of ``roles``'
    where the agent plays several (a shared policy: evaluated per role); None: not evaluated."""
    key = MicroBatchKey(run, version, 0)
    if not store.is_committed("evaluations", key):
        return None
    metrics = stored_metrics(store.read("evaluations", key, columns=["agent", "metrics"]))
    shared = {"roles": {role: metrics.get(role) for role in roles}} if roles != [agent] else {}
    return {"metrics": metrics.get(agent), "team": metrics.get("team"), **shared}


def step_health_row(store: ExperienceStore, run: str, agent: str, step: int) -> dict | None:
    """The agent's row of the step's ``health`` partition (step and signals, not when the step finished); None when it
    is not stored."""
    key = MicroBatchKey(run, step, 0)
    if not store.is_committed("health", key):
        return None
    rows = store.read("health", key, agent=agent).drop_columns(["agent", "step_finished"]).to_pylist()
    return {"step": step, **rows[0]} if rows else None


def covering_launches(launches: list[dict], version: int) -> list[dict]:
    """The launches (of a launch record's history) whose steps include one of steps 0..version-1, the steps that
    trained ``version``; for version 0, made as the run first launched, the run's first launch."""
    return [launch for launch in launches if launch["first_step"] < version] if version else launches[:1]


class ServedVersions:
    """Each step's served policy versions per agent, for a launch's view of its versions as they commit: taken from
    the rollouts the launch commits (no read), and read from the store only for micro-batches committed before it.

    Args:
        store: the run's store.
        run: the run.
        micro_batches: micro-batches per step.
    """

    def __init__(self, store: ExperienceStore, run: str, micro_batches: int) -> None:
        self.store, self.run, self.micro_batches = store, run, micro_batches
        self._seen: dict[int, dict[int, pa.Table]] = {}

    def add(self, key: MicroBatchKey, rollouts: pa.Table) -> None:
        """Note a committed rollouts partition (a table with agent and policy_version columns)."""
        distinct = rollouts.select(["agent", "policy_version"]).group_by(["agent", "policy_version"]).aggregate([])
        self._seen.setdefault(key.step, {})[key.micro_batch] = distinct

    def at(self, step: int) -> dict[str, list[int]]:
        """Agent -> the versions that served its turns in ``step``."""
        seen = self._seen.get(step, {})
        tables = [seen[m] if m in seen else self.store.read("rollouts", MicroBatchKey(self.run, step, m),
                                                            columns=["agent", "policy_version"])
                  for m in range(self.micro_batches)]
        table = pa.concat_tables(tables).append_column("step", pa.array([step] * sum(map(len, tables)), pa.int32()))
        return served_versions(table).get(step, {})

    def forget(self, step: int) -> None:
        """Drop what is kept of ``step`` and earlier steps (every agent has committed past them)."""
        for older in [number for number in self._seen if number <= step]:
            del self._seen[older]
