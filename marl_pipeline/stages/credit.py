"""Credit assignment arithmetic: the team mix, and a plugin's per-turn rewards and weights checked (the reward stage,
``stages/reward.py``, applies them to a micro-batch; stages/advantages/ turns the rewards into advantages)."""

from __future__ import annotations

import numpy as np

from marl_pipeline.hooks import hooks_of


def assign_credit(own: dict[str, float], team_weight: float) -> dict[str, float]:
    """Each agent's reward: ``team_weight * mean(own over agents) + (1 - team_weight) * own[agent]``."""
    if not 0.0 <= team_weight <= 1.0:
        raise ValueError(f"team_weight must be in [0, 1], got {team_weight}")
    if not own:
        return {}
    team = sum(own.values()) / len(own)
    return {agent: team_weight * team + (1.0 - team_weight) * value for agent, value in own.items()}


def checked_turn_rewards(rewards: object, turns: int) -> list[float] | None:
    """``score_turns``' answer: None, or one finite reward per turn; else a clear error."""
    if rewards is None:
        return None
    if not isinstance(rewards, list | tuple) or len(rewards) != turns:
        raise ValueError(f"score_turns returned {rewards!r:.120}, expected a list of one reward per turn ({turns}) "
                         "or None")
    values = [float(value) for value in rewards]
    if not all(np.isfinite(values)):
        raise ValueError(f"score_turns returned a reward that is not finite: {values}")
    return values


def turn_weights_of(env: object, task: dict, transcript: list, turns: int) -> list[float]:
    """A plugin's ``turn_weights(task, transcript)`` for an episode's turns, checked (every turn 1 without it)."""
    hook = hooks_of(env).turn_weights
    return checked_turn_weights(hook(task, transcript) if hook is not None else None, turns)


def checked_turn_weights(weights: object, turns: int) -> list[float]:
    """``turn_weights``' answer: None (every turn 1), or one finite weight >= 0 per turn; else a clear error.

    Why weights: turns of one agent share its weights and AdamW moments, so a turn with dense advantages (a
    verifier's verdict, which agrees or not in every episode) sets the size of every update and can drown a turn
    whose signal is rare (its working, right in a few samples a step); weighting the dense turn down gives the rare
    signal more of each update."""
    if weights is None:
        return [1.0] * turns
    if not isinstance(weights, list | tuple) or len(weights) != turns:
        raise ValueError(f"turn_weights returned {weights!r:.120}, expected a list of one weight per turn ({turns}) "
                         "or None")
    values = [float(value) for value in weights]
    if not all(np.isfinite(values)) or min(values, default=0.0) < 0:
        raise ValueError(f"turn_weights returned a weight that is negative or not finite: {values}")
    return values
