"""Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-like training"): GRPO without the division by the group's std,
which weights groups of nearly equal rewards (too easy or too hard) the most. Its other half, no per-response
length normalisation, is ``algorithm.loss_normalization: token``."""

from __future__ import annotations

import numpy as np

from marl_pipeline.config import DrGRPOAdvantage
from marl_pipeline.stages.advantages.groups import ScoredRows, group_mean


def advantages(rows: ScoredRows, settings: DrGRPOAdvantage) -> np.ndarray:
    """reward - group mean."""
    return rows.rewards - group_mean(rows.rewards, rows.groups)
