"""Held-out evaluations during a launch: which policy versions are evaluated, and committing each version's
evaluation once every agent has answered.

Each agent is evaluated on its own engine right after that engine loads a due version (its publisher
thread; the engine's calls are serialised by Ray, so no weight change can fall inside the evaluation),
so agents never wait for each other; the last agent to deliver commits the version's partition. Where the team is
measured too (stages/team.py), the last agent plays the team's episodes on every agent's engine first, and each
other agent's publisher waits for that before its engine loads a newer version (:meth:`wait_until_measured`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import pyarrow as pa

from marl_pipeline.environment import Environment
from marl_pipeline.inference.replicas import EngineReplicas
from marl_pipeline.run.events import EvaluationCommitted
from marl_pipeline.stages.evaluation import (
    EvaluationSettings,
    evaluate_agent,
    stored_metrics,
    with_metrics,
)
from marl_pipeline.stages.team import evaluate_team, is_team_evaluated
from marl_pipeline.store import ExperienceStore, MicroBatchKey


class EvaluationRounds:
    """Evaluates versions 0, every, 2*every, ... and ``last_version`` of every agent of one launch."""

    def __init__(self, env: Environment, store: ExperienceStore, run: str, roles: dict[str, str], every: int,
                 last_version: int, settings: EvaluationSettings) -> None:
        """``roles``: the agent playing each role (``ExperimentConfig.role_agents``): each role is evaluated, on the
        engine of its agent."""
        self.env, self.store, self.run, self.roles = env, store, run, roles
        self.agents = list(dict.fromkeys(roles.values()))
        self.every, self.last_version, self.settings = every, last_version, settings
        self.team = is_team_evaluated(env, settings)
        self._lock = threading.Lock()
        self._parts: dict[int, dict[str, pa.Table]] = {}
        self._measured: dict[int, threading.Event] = {}  # versions under way, set when committed

    def due(self, version: int) -> bool:
        """Whether ``version`` is evaluated and not yet committed (a resumed launch skips committed ones)."""
        wanted = version % self.every == 0 or version == self.last_version
        return wanted and not self.store.is_committed("evaluations", MicroBatchKey(self.run, version, 0))

    def evaluate(self, agent: str, replicas: dict[str, EngineReplicas], version: int) -> EvaluationCommitted | None:
        """Evaluate each role ``agent`` plays at ``version`` (the version its engine serves now) on one of its
        replicas (``replicas``: every agent's); returns the commit event when this was the last agent of the version,
        which measures the team too (every engine serves ``version`` then: the others wait in
        :meth:`wait_until_measured`)."""
        engines = {role: replicas[player].primary() for role, player in self.roles.items()}
        table = pa.concat_tables([evaluate_agent(self.env, role, engines[role], self.settings)
                                  for role, player in self.roles.items() if player == agent])
        served = set(table.column("policy_version").to_pylist())
        if served - {version}:  # a bug, not a fault: the caller must hold the engine at this version
            raise RuntimeError(f"evaluation of {agent} v{version}: the engine served versions {served}")
        with self._lock:
            parts = self._parts.setdefault(version, {})
            measured = self._measured.setdefault(version, threading.Event())
            parts[agent] = table
            if len(parts) < len(self.agents):
                return None
            del self._parts[version]
        try:
            tables = [parts[a] for a in self.agents]
            if self.team:
                team = evaluate_team(self.env, engines, self.settings)
                if set(team.column("policy_version").to_pylist()) - {version}:
                    raise RuntimeError(f"the team's evaluation at v{version} ran on engines past it")
                tables.append(team)
            combined, metrics = with_metrics(self.env, pa.concat_tables(tables))
            path = self.store.commit("evaluations", MicroBatchKey(self.run, version, 0), combined)
        finally:
            with self._lock:
                del self._measured[version]
            measured.set()
        return EvaluationCommitted(version, path, metrics)

    def wait_until_measured(self, version: int, stopped: Callable[[], bool]) -> None:
        """Return once ``version``'s evaluation is committed, if the team is measured and it is under way (an agent's
        engine must not load a newer version while the team plays at this one), or once ``stopped()``."""
        with self._lock:
            measured = self._measured.get(version) if self.team else None
        while measured is not None and not measured.wait(0.1) and not stopped():
            pass


def evaluation_history(store: ExperienceStore, run: str) -> dict[int, dict[str, dict[str, float]]]:
    """Every committed evaluation of a run, from the metrics stored with it: version -> agent -> metrics."""
    keys = sorted(store.committed_keys(run, "evaluations"), key=lambda key: key.step)
    return {key.step: stored_metrics(store.read("evaluations", key, columns=["agent", "metrics"])) for key in keys}
