"""Agent-wise normalisation (after Dr. MAS, Feng et al. 2026): a group-mean baseline, divided by the std of the
agent's own centred rewards over the whole micro-batch.

Why: agents of a team earn rewards of different spread (a verifier's verdict is right far more often than a
solver's answer). One scale for every agent lets the widest set the size of every update; a scale per group, as in
GRPO, blows a group of nearly equal rewards up to +-1. Here each agent's advantages have unit spread over the
micro-batch, whatever the other agents' rewards and whatever one group's spread.
"""

from __future__ import annotations

import numpy as np

from marl_pipeline.config import AgentNormalizedAdvantage
from marl_pipeline.stages.advantages.groups import ScoredRows, group_mean, group_std


def advantages(rows: ScoredRows, settings: AgentNormalizedAdvantage) -> np.ndarray:
    """(reward - group mean) / (std over the agent's rows of (reward - group mean) + eps), per role of a shared
    policy."""
    centred = rows.rewards - group_mean(rows.rewards, rows.groups)
    return centred / (group_std(centred, rows.players()) + settings.eps)
