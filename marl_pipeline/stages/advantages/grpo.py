"""GRPO (Shao et al. 2024, DeepSeekMath): each reward against its group, in units of the group's std."""

from __future__ import annotations

import numpy as np

from marl_pipeline.config import GRPOAdvantage
from marl_pipeline.stages.advantages.groups import ScoredRows, group_mean, group_std


def advantages(rows: ScoredRows, settings: GRPOAdvantage) -> np.ndarray:
    """(reward - group mean) / (group std + eps). A group whose rewards are all equal gets 0."""
    centred = rows.rewards - group_mean(rows.rewards, rows.groups)
    return centred / (group_std(rows.rewards, rows.groups) + settings.eps)
