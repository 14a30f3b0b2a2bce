"""Episodes as the environment and reward stages see them: a micro-batch's turn rows grouped per episode."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc

from marl_pipeline.environment import Turn

TURN_KEYS = ("sample_id", "episode", "task_id", "group_id", "trajectory", "role", "turn", "agent")
"""Columns that name a turn; every stage's row of that turn repeats them."""


DROPPED = "dropped"
"""The rollout status of an episode over-sampling cut or left out (stages/trajectories.py): stored, never executed,
scored or trained on."""


def kept_turns(rollouts: pa.Table) -> pa.Table:
    """The rollout rows of the episodes their groups kept: every row but those over-sampling dropped."""
    if "status" not in rollouts.column_names:
        return rollouts
    return rollouts.filter(pc.fill_null(pc.not_equal(rollouts.column("status"), DROPPED), True))


def episodes_of(rollouts: pa.Table) -> list[list[dict]]:
    """Rows of a rollouts table grouped by episode, each episode's turns in order."""
    rows = rollouts.sort_by([("episode", "ascending"), ("turn", "ascending")]).to_pylist()
    episodes: dict[int, list[dict]] = {}
    for row in rows:
        episodes.setdefault(row["episode"], []).append(row)
    return list(episodes.values())


def transcript_of(turns: list[dict]) -> list[Turn]:
    """The plugin's view of an episode's turns (what ``render_prompt``, ``execute`` and ``score`` receive)."""
    return [Turn(row["role"], row["response_text"], row.get("observation")) for row in turns]
