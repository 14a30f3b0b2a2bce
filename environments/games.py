"""What the game adapters (textarena_games.py, pettingzoo_aec.py) share: a game's outcome as a reward."""

from __future__ import annotations

import numpy as np


def outcome_reward(reward: float) -> float:
    """A game's reward in the convention of TextArena and PettingZoo's classic games (win 1, draw 0, loss -1) as a
    reward in [0, 1]: 1, 0.5, 0; other payoffs are clipped to that range."""
    return float(np.clip((reward + 1) / 2, 0.0, 1.0))
