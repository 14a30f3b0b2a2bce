"""Reward stage: the environment's per-agent reward of each episode, and group-relative advantages.

GRPO: the ``n`` episodes sampled from one task prompt form a group; an agent's advantage in an episode
is its reward minus the group's mean reward for that agent, divided by the group's std (plus eps).
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


def score_micro_batch(env: Environment, rollouts: pa.Table, results: pa.Table, eps: float) -> pa.Table:
    """One row per turn: the turn's agent's episode reward and its group-relative advantage."""
    outcomes = {row["sample_id"]: row for row in results.select(["sample_id", "outcome", "success", "observation",
                                                                  "info", "status"]).to_pylist()}
    keyed_rows, rewards, statuses, starts, ends = [], [], [], [], []
    for turns in episodes_of(rollouts.select(list(_KEYS) + ["task", "response_text"])):
        start = datetime.now(UTC)
        episode_results = [outcomes[row["sample_id"]] for row in turns]
        if any(r["status"] != "ok" for r in episode_results):
            per_role, status = {}, "failed"  # a failed episode earns nothing
        else:
            actions = [ActionResult(r["outcome"], r["success"], r["observation"], json.loads(r["info"]))
                       for r in episode_results]
            per_role, status = env.score(json.loads(turns[0]["task"]), transcript_of(turns), actions), "ok"
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
