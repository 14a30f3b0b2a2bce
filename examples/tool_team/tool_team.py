"""A plugin written by following docs/environments.md only: a team that calls a tool.

The ``caller`` sees ``a+b+c`` and writes the call ``a+b`` for the calculator; the environment runs the call
(``observe``: the tool's reply, which the next turn sees); the ``answerer`` sees only the tool's reply and ``c``,
and answers the sum. Both share the team reward (``team_reward_weight = 1``): right when the answer is ``a+b+c``.

An installable example (pyproject.toml beside this file): ``make plugin P=examples/tool_team``, then configs name
``docs_tool_team``. Scripts and tests register it in-process instead (``register_environment``).
"""

from __future__ import annotations

import re

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from marl_pipeline.environment import ActionResult, Task, Turn

CALL = re.compile(r"^\s*(\d+)\s*\+\s*(\d+)\s*$")


def calculator(call: str) -> str:
    """The tool: the sum of a call ``x+y``, or ``error`` for anything else."""
    found = CALL.match(call)
    return str(int(found[1]) + int(found[2])) if found else "error"


class ToolOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    max_operand: int = Field(9, ge=1, le=99)
    """``a``, ``b`` and ``c`` are drawn from 0..max_operand."""


class ToolTeam:
    name = "docs_tool_team"
    turn_order = ("caller", "answerer")
    Options = ToolOptions
    team_reward_weight = 1.0

    def __init__(self, options: ToolOptions) -> None:
        self.options = options

    def sample_tasks(self, rng: np.random.Generator, count: int) -> list[Task]:
        a, b, c = rng.integers(0, self.options.max_operand + 1, size=(3, count)).tolist()
        return [{"id": f"{x}+{y}+{z}", "a": x, "b": y, "c": z} for x, y, z in zip(a, b, c)]

    def render_prompt(self, role: str, task: Task, transcript: list[Turn]) -> str:
        if role == "caller":
            return f"{task['a']}+{task['b']}+{task['c']} call:"
        return f"tool {transcript[0].observation or 'error'} plus {task['c']}:"

    def observe(self, role: str, task: Task, transcript: list[Turn]) -> str | None:
        return calculator(transcript[-1].text) if role == "caller" else None

    def execute(self, task: Task, transcript: list[Turn]) -> list[ActionResult]:
        called = transcript[0].observation not in (None, "error")
        answer = transcript[1].text.strip()
        right = answer == str(task["a"] + task["b"] + task["c"])
        return [ActionResult("called" if called else "bad_call", called), ActionResult("right" if right else "wrong",
                                                                                        right)]

    def score(self, task: Task, transcript: list[Turn], results: list[ActionResult]) -> dict[str, float]:
        return {"caller": float(results[1].success), "answerer": float(results[1].success)}

    def text_corpus(self, rng: np.random.Generator, count: int) -> list[str]:
        return [p + c for role in self.turn_order for p, c in self.warmup_examples(role, rng, count)]

    def warmup_examples(self, role: str, rng: np.random.Generator, count: int) -> list[tuple[str, str]]:
        tasks = self.sample_tasks(rng, count)
        if role == "caller":
            return [(self.render_prompt("caller", t, []), f"{t['a']}+{t['b']}") for t in tasks]
        return [(self.render_prompt("answerer", t, [Turn("caller", "", observation=str(t["a"] + t["b"]))]),
                 str(t["a"] + t["b"] + t["c"])) for t in tasks]
