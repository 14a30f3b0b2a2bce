"""Environment stage: execute each finished episode's actions and record the outcome of every turn.

Two ways, chosen by the plugin:

- ``execute(task, transcript)`` per episode (the demo): in-process, one result per turn.
- ``actions`` + ``run_action`` (an :class:`ActionEnvironment`): every turn's action of the whole
  micro-batch is scheduled on its own, per action, on the :class:`ActionPool` passed in (the train
  job's own pool, a recomputation's shared one, both sized by :func:`action_pool_settings`); without one, the
  actions run in-process.

Failures are contained: an environment that raises for one episode records that episode as failed
(status ``failed``, it earns nothing); a malformed, failed or timed-out action records a failure for
that turn only (status ``action_failed``, the reason in ``error``) and the episode is still scored.
"""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime

import pyarrow as pa

from marl_pipeline.actions.pool import ActionPool
from marl_pipeline.actions.worker import ActionOutcome, Job
from marl_pipeline.config import PoolSettings
from marl_pipeline.environment import ActionResult, Environment, validate_action
from marl_pipeline.hooks import hooks_of
from marl_pipeline.stages.episodes import TURN_KEYS, episodes_of, kept_turns, transcript_of
from marl_pipeline.store.schema import ENVIRONMENT_RESULTS, with_agent


def is_action_environment(env: Environment) -> bool:
    """Whether the plugin's turns run as actions on the pool (``actions`` + ``run_action``)."""
    return hooks_of(env).uses_actions


def action_pool_settings(env: Environment, configured: PoolSettings | None) -> PoolSettings | None:
    """The action pool a run needs: the config's settings, else the plugin's ``pool_settings``, else the
    defaults; None for a plugin without actions."""
    if not is_action_environment(env):
        return None
    return configured or hooks_of(env).pool_settings or PoolSettings()


def execute_micro_batch(env: Environment, rollouts: pa.Table, pool: ActionPool | None = None) -> pa.Table:
    """One row per turn of a kept episode (none for those over-sampling dropped): the outcome of executing that
    turn's action."""
    columns: dict[str, list] = {name: [] for name in ENVIRONMENT_RESULTS.names + ["agent"]}
    episodes = episodes_of(kept_turns(rollouts.select([*TURN_KEYS, "task", "response_text", "observation", "status",
                                                       "error"])))
    start = datetime.now(UTC)
    failed = {e: _rollout_failed(turns) for e, turns in enumerate(episodes)}
    runnable = [turns for e, turns in enumerate(episodes) if failed[e] is None]
    if is_action_environment(env):
        done = iter(_run_actions(env, runnable, pool))
    else:
        done = iter([_execute_episode(env, turns) for turns in runnable])
    per_episode = [next(done) if failed[e] is None else failed[e] for e in range(len(episodes))]
    end = datetime.now(UTC)
    for turns, rows in zip(episodes, per_episode):
        for turn, (result, status, error) in zip(turns, rows):
            for name in TURN_KEYS:
                columns[name].append(turn[name])
            columns["outcome"].append(result.outcome)
            columns["success"].append(result.success)
            columns["observation"].append(result.observation)
            columns["info"].append(json.dumps(result.info, sort_keys=True))
            columns["environment_start"].append(start)
            columns["environment_end"].append(end)
            columns["status"].append(status)
            columns["error"].append(error)
    return pa.table(columns, schema=with_agent(ENVIRONMENT_RESULTS))


Row = tuple[ActionResult, str, str | None]  # (result, status, error) of one turn


def _rollout_failed(turns: list[dict]) -> list[Row] | None:
    """The episode's rows as failed when a turn of its rollout failed (its ``observe`` raised), else None."""
    errors = [row.get("error") or row["status"] for row in turns if row.get("status", "ok") != "ok"]
    return [(ActionResult("error", False), "failed", errors[0]) for _ in turns] if errors else None


def _execute_episode(env: Environment, turns: list[dict]) -> list[Row]:
    try:
        results = env.execute(json.loads(turns[0]["task"]), transcript_of(turns))
        if len(results) != len(turns):
            raise ValueError(f"execute returned {len(results)} results for {len(turns)} turns")
        return [(result, "ok", None) for result in results]
    except Exception as exc:
        return _episode_failed(turns, exc)


def _episode_failed(turns: list[dict], exc: Exception) -> list[Row]:
    error = f"{type(exc).__name__}: {exc}"
    return [(ActionResult("error", False), "failed", error) for _ in turns]


def _run_actions(env, episodes: list[list[dict]], pool: ActionPool | None) -> list[list[Row]]:
    """Collect every valid action of the micro-batch, run them all at once, put the outcomes back per turn."""
    max_bytes = hooks_of(env).max_action_bytes
    rows: list[list[Row | None]] = []
    jobs: list[Job] = []
    places: list[tuple[int, int]] = []  # (episode, turn) of each job
    for e, turns in enumerate(episodes):
        try:
            actions = env.actions(json.loads(turns[0]["task"]), transcript_of(turns))
            if len(actions) != len(turns):
                raise ValueError(f"actions returned {len(actions)} actions for {len(turns)} turns")
        except Exception as exc:
            rows.append(_episode_failed(turns, exc))
            continue
        episode_rows: list[Row | None] = []
        for t, action in enumerate(actions):
            if action is None:
                episode_rows.append((ActionResult("no_action", True), "ok", None))
            elif (reason := validate_action(action, max_bytes)) is not None:
                episode_rows.append((ActionResult("malformed_action", False, info={"reason": reason}),
                                     "action_failed", f"malformed action: {reason}"))
            else:
                episode_rows.append(None)
                jobs.append(Job(env.run_action, (action,), float(action.expected_cost)))
                places.append((e, t))
        rows.append(episode_rows)
    outcomes = pool.map(jobs) if pool is not None else [_run_inline(job) for job in jobs]
    for (e, t), outcome in zip(places, outcomes):
        rows[e][t] = _row_of(outcome)
    return rows  # type: ignore[return-value]


def _run_inline(job: Job) -> ActionOutcome:
    try:
        return ActionOutcome("ok", job.fn(*job.args), None, 1, time.monotonic())
    except Exception as exc:
        return ActionOutcome("failed", None, f"{type(exc).__name__}: {exc}", 1, time.monotonic())


def _row_of(outcome: ActionOutcome) -> Row:
    if outcome.status == "ok" and isinstance(outcome.value, ActionResult):
        return outcome.value, "ok", None
    if outcome.status == "ok":
        reason = f"run_action returned {type(outcome.value).__name__}, expected ActionResult"
        return ActionResult("action_error", False, info={"reason": reason}), "action_failed", reason
    name = {"failed": "action_error"}.get(outcome.status, outcome.status)
    return ActionResult(name, False, info={"reason": outcome.error}), "action_failed", outcome.error

