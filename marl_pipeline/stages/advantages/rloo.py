"""RLOO (Ahmadian et al. 2024, "Back to basics"): each episode's reward against the mean of the other episodes of
its group, a baseline that does not depend on the episode itself (so the estimate is unbiased)."""

from __future__ import annotations

import numpy as np

from marl_pipeline.config import RLOOAdvantage
from marl_pipeline.stages.advantages.groups import ScoredRows, group_size, group_sum, labels


def advantages(rows: ScoredRows, settings: RLOOAdvantage) -> np.ndarray:
    """reward - the mean of the group's rows from other episodes (an agent's several turns in one episode leave
    out together); 0 in a group of one episode."""
    own = labels(rows.groups, rows.episodes)
    others = group_size(rows.groups) - group_size(own)
    others_sum = group_sum(rows.rewards, rows.groups) - group_sum(rows.rewards, own)
    baseline = np.divide(others_sum, others, out=np.zeros_like(others), where=others > 0)
    return np.where(others > 0, rows.rewards - baseline, 0.0)
