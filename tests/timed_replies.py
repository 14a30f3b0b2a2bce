"""A three-turn test environment (writer, checker, writer) on additions, whose replies take as long as a test
needs: every reply ``reply_s`` seconds, and task 0's ``slow_s`` more. Shared by the trajectory-level rollout and
the engine replica tests."""

from __future__ import annotations

import time
from typing import ClassVar

import numpy as np
from pydantic import BaseModel

from marl_pipeline.environment import ActionResult, Turn


class TimedReplies:
    name = "timed-replies"
    turn_order: ClassVar[tuple[str, ...]] = ("writer", "checker", "writer")
    Options = BaseModel

    def __init__(self, slow_s: float = 0.0, reply_s: float = 0.0) -> None:
        self.slow_s, self.reply_s = slow_s, reply_s

    def sample_tasks(self, rng: np.random.Generator, count: int) -> list[dict]:
        return [{"id": i, "a": int(rng.integers(10)), "b": int(rng.integers(10))} for i in range(count)]

    def render_prompt(self, role: str, task: dict, transcript: list[Turn]) -> str:
        return f"{task['a']}+{task['b']}=" + "".join(turn.text[:6] for turn in transcript)

    def observe(self, role: str, task: dict, transcript: list[Turn]) -> str:
        time.sleep(self.reply_s + (self.slow_s if task["id"] == 0 else 0.0))
        return "ok"

    def execute(self, task: dict, transcript: list[Turn]) -> list[ActionResult]:
        return [ActionResult("done", True) for _ in transcript]

    def score(self, task: dict, transcript: list[Turn], results: list[ActionResult]) -> dict[str, float]:
        return {"writer": float(task["a"] % 2), "checker": 1.0}


class ChosenReplies(TimedReplies):
    """:class:`TimedReplies` whose chosen episodes, named (task id, trajectory), hang in their first reply for
    ``hang_s`` or raise in it (each episode's task carries its trajectory: ``episode_task``)."""

    def __init__(self, hang: set[tuple[int, int]] = frozenset(), fail: set[tuple[int, int]] = frozenset(),
                 hang_s: float = 20.0) -> None:
        super().__init__()
        self.hang, self.fail, self.hang_s = hang, fail, hang_s

    def episode_task(self, task: dict, trajectory: int) -> dict:
        return {**task, "trajectory": trajectory}

    def observe(self, role: str, task: dict, transcript: list[Turn]) -> str:
        episode = (task["id"], task["trajectory"])
        if len(transcript) == 1 and episode in self.fail:
            raise RuntimeError(f"episode {episode} fails")
        if len(transcript) == 1 and episode in self.hang:
            time.sleep(self.hang_s)
        return super().observe(role, task, transcript)
