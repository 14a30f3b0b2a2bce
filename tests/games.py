"""Playing a game environment's hooks by hand: the replies in the order the game asks for them."""

from __future__ import annotations

from marl_pipeline.environment import Turn
from marl_pipeline.stages.rollout import next_turn


def play(env, task: dict, replies: list[str]) -> list[Turn]:
    """The transcript of ``replies``, each by the role whose turn the game says it is."""
    transcript: list[Turn] = []
    for reply in replies:
        role = next_turn(env, task, transcript)
        assert role is not None, f"the game ended before {reply}"
        transcript.append(Turn(role, reply))
    return transcript
