"""Advantage estimators, one module each, chosen by ``algorithm.advantage.type``.

Each is ``advantages(rows, settings) -> advantages``: a micro-batch's scored turn rows (:class:`ScoredRows`) and the
estimator's own config slice in, one float64 advantage per row out. The reward stage scales the result by the
plugin's turn weights.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from marl_pipeline.config import Advantage
from marl_pipeline.stages.advantages import agent_normalized, dr_grpo, grpo, rloo
from marl_pipeline.stages.advantages.groups import ScoredRows

ESTIMATORS = {"grpo": grpo.advantages, "dr_grpo": dr_grpo.advantages, "rloo": rloo.advantages,
              "agent_normalized": agent_normalized.advantages}

__all__ = ["ESTIMATORS", "ScoredRows", "estimator"]


def estimator(settings: Advantage) -> Callable[[ScoredRows], np.ndarray]:
    """The estimator ``settings`` names, bound to them."""
    compute = ESTIMATORS[settings.type]
    return lambda rows: compute(rows, settings)
