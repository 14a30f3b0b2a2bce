"""What the game adapters (textarena_games.py, pettingzoo_aec.py) share: a game's task, and its outcome as a reward."""

from __future__ import annotations

import numpy as np


def outcome_reward(reward: float) -> float:
    """A game's reward in the convention of TextArena and PettingZoo's classic games (win 1, draw 0, loss -1) as a
    reward in [0, 1]: 1, 0.5, 0; other payoffs are clipped to that range."""
    return float(np.clip((reward + 1) / 2, 0.0, 1.0))


TRAINING_SEEDS = 1 << 40
"""Training draws its games' seeds below this; held-out games' seeds start here."""


def game_task(seed: int) -> dict:
    """The task of the game played from ``seed``."""
    return {"id": f"game-{seed}", "seed": int(seed)}


def sample_game_tasks(rng: np.random.Generator, count: int) -> list[dict]:
    """``count`` training games (``sample_tasks``): seeds below :data:`TRAINING_SEEDS`."""
    return [game_task(seed) for seed in rng.integers(0, TRAINING_SEEDS, count)]
