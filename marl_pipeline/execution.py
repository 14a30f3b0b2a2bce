"""Environment stage: execute each finished episode's actions and record the outcome of every turn.

An environment that raises on one episode records a failure for that episode's turns and the others
go on: a bad episode never blocks the micro-batch.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pyarrow as pa

from marl_pipeline.environment import ActionResult, Environment, Turn
from marl_pipeline.schema import ENVIRONMENT_RESULTS, with_agent

_KEYS = ("sample_id", "episode", "task_id", "trajectory", "role", "turn", "agent")


def episodes_of(rollouts: pa.Table) -> list[list[dict]]:
    """Rows of a rollouts table grouped by episode, each episode's turns in order."""
    rows = rollouts.sort_by([("episode", "ascending"), ("turn", "ascending")]).to_pylist()
    episodes: dict[int, list[dict]] = {}
    for row in rows:
        episodes.setdefault(row["episode"], []).append(row)
    return list(episodes.values())


def transcript_of(turns: list[dict]) -> list[Turn]:
    return [Turn(row["role"], row["response_text"]) for row in turns]


def execute_micro_batch(env: Environment, rollouts: pa.Table) -> pa.Table:
    """One row per turn: the outcome of executing that turn's action."""
    columns: dict[str, list] = {name: [] for name in ENVIRONMENT_RESULTS.names + ["agent"]}
    for turns in episodes_of(rollouts.select(list(_KEYS) + ["task", "response_text"])):
        task = json.loads(turns[0]["task"])
        start = datetime.now(UTC)
        try:
            results = env.execute(task, transcript_of(turns))
            if len(results) != len(turns):
                raise ValueError(f"execute returned {len(results)} results for {len(turns)} turns")
            status, error = "ok", None
        except Exception as exc:
            results = [ActionResult("error", False) for _ in turns]
            status, error = "failed", f"{type(exc).__name__}: {exc}"
        end = datetime.now(UTC)
        for row, result in zip(turns, results):
            for name in _KEYS:
                columns[name].append(row[name])
            columns["outcome"].append(result.outcome)
            columns["success"].append(result.success)
            columns["observation"].append(result.observation)
            columns["info"].append(json.dumps(result.info, sort_keys=True))
            columns["environment_start"].append(start)
            columns["environment_end"].append(end)
            columns["status"].append(status)
            columns["error"].append(error)
    return pa.table(columns, schema=with_agent(ENVIRONMENT_RESULTS))
