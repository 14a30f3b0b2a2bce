"""Reward stage: the environment's per-agent reward of each episode, and group-relative advantages.

GRPO: the ``n`` episodes sampled from one task prompt form a group; an agent's advantage in an episode
is its reward minus the group's mean reward for that agent, divided by the group's std (plus eps).

Credit assignment: the environment scores each agent on its own part (``score``); each agent is then
trained on ``w * team + (1 - w) * own`` where ``team`` is the mean over the episode's agents and ``w``
the ``team_weight`` (0: individual reward, the default; 1: shared team reward; between: a mix). A
plugin sets its default with a ``team_reward_weight`` attribute (usually from its options).
"""

from __future__ import annotations

import json
from datetime import UTC, datetime

import numpy as np
import pyarrow as pa

from marl_pipeline.environment import ActionResult, Environment
from marl_pipeline.execution import episodes_of, transcript_of
from marl_pipeline.schema import REWARDS, with_agent

_KEYS = ("sample_id", "episode", "task_id", "trajectory", "role", "turn", "agent")


def group_relative_advantages(rewards: np.ndarray, groups: np.ndarray, eps: float) -> np.ndarray:
    """(reward - group mean) / (group std + eps) for each element, groups given by label."""
    advantages = np.zeros_like(rewards, dtype=np.float64)
    for label in np.unique(groups):
        members = groups == label
        values = rewards[members]
        advantages[members] = (values - values.mean()) / (values.std() + eps)
    return advantages


def assign_credit(own: dict[str, float], team_weight: float) -> dict[str, float]:
    """Each agent's reward: ``team_weight * mean(own over agents) + (1 - team_weight) * own[agent]``."""
    if not 0.0 <= team_weight <= 1.0:
        raise ValueError(f"team_weight must be in [0, 1], got {team_weight}")
    if not own:
        return {}
    team = sum(own.values()) / len(own)
    return {agent: team_weight * team + (1.0 - team_weight) * value for agent, value in own.items()}


def score_micro_batch(env: Environment, rollouts: pa.Table, results: pa.Table, eps: float,
                      team_weight: float | None = None) -> pa.Table:
    """One row per turn: the turn's agent's episode reward and its group-relative advantage.

    ``team_weight`` None takes the environment's ``team_reward_weight`` (0 if it has none).
    """
    if team_weight is None:
        team_weight = float(getattr(env, "team_reward_weight", 0.0))
    outcomes = {row["sample_id"]: row for row in results.select(["sample_id", "outcome", "success", "observation",
                                                                  "info", "status"]).to_pylist()}
    keyed_rows, rewards, statuses, starts, ends = [], [], [], [], []
    for turns in episodes_of(rollouts.select(list(_KEYS) + ["task", "response_text"])):
        start = datetime.now(UTC)
        episode_results = [outcomes[row["sample_id"]] for row in turns]
        if any(r["status"] == "failed" for r in episode_results):
            per_role, status = {}, "failed"  # a failed episode earns nothing; a failed action is scored by the env
        else:
            actions = [ActionResult(r["outcome"], r["success"], r["observation"], json.loads(r["info"]))
                       for r in episode_results]
            own = env.score(json.loads(turns[0]["task"]), transcript_of(turns), actions)
            per_role, status = assign_credit(own, team_weight), "ok"
        end = datetime.now(UTC)
        for row in turns:
            keyed_rows.append(row)
            rewards.append(float(per_role.get(row["role"], 0.0)))
            statuses.append(status)
            starts.append(start)
            ends.append(end)
    rewards_array = np.asarray(rewards, dtype=np.float64)
    # A group is one task prompt's n episodes, per agent: input_id is the sample_id before its turn suffix.
    groups = np.asarray([f"{row['sample_id'].split('_')[0]}/{row['agent']}" for row in keyed_rows])
    advantages = group_relative_advantages(rewards_array, groups, eps) if keyed_rows else rewards_array
    columns = {name: [row[name] for row in keyed_rows] for name in _KEYS}
    columns.update(reward=rewards_array.astype(np.float32), advantage=advantages.astype(np.float32),
                   reward_start=starts, reward_end=ends, status=statuses, error=[None] * len(keyed_rows))
    return pa.table(columns, schema=with_agent(REWARDS))
