"""A plugin written by following docs/environments.md only: a two-agent relay game.

The ``sender`` sees a colour and names it; the ``receiver`` sees only the sender's words and must
repeat the colour. Both share the team reward (``team_reward_weight = 1``).

An installable example: ``make plugin P=examples/relay_plugin`` installs it into the project's ``.venv``
(pyproject.toml beside this file declares its entry point), and configs then name ``docs_relay``. The tests
register it in-process instead (``register_environment``).
"""

from __future__ import annotations

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from marl_pipeline.environment import ActionResult, Task, Turn

COLOURS = ("red", "blue", "green", "gold")


class RelayOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    colours: int = Field(4, ge=2, le=len(COLOURS))
    """How many colours the tasks draw from."""


class RelayGame:
    name = "docs_relay"
    turn_order = ("sender", "receiver")
    Options = RelayOptions
    team_reward_weight = 1.0

    def __init__(self, options: RelayOptions) -> None:
        self.colours = COLOURS[: options.colours]

    def sample_tasks(self, rng: np.random.Generator, count: int) -> list[Task]:
        return [{"id": colour, "colour": colour} for colour in rng.choice(self.colours, size=count)]

    def render_prompt(self, role: str, task: Task, transcript: list[Turn]) -> str:
        if role == "sender":
            return f"say {task['colour']}:"
        return f"heard {transcript[0].text.strip()[:20]}:"

    def execute(self, task: Task, transcript: list[Turn]) -> list[ActionResult]:
        said = transcript[1].text.strip()
        return [ActionResult("sent", True), ActionResult("match" if said == task["colour"] else "miss",
                                                         said == task["colour"])]

    def score(self, task: Task, transcript: list[Turn], results: list[ActionResult]) -> dict[str, float]:
        return {"sender": float(results[1].success), "receiver": float(results[1].success)}

    def text_corpus(self, rng: np.random.Generator, count: int) -> list[str]:
        return [p + c for role in self.turn_order for p, c in self.warmup_examples(role, rng, count)]

    def warmup_examples(self, role: str, rng: np.random.Generator, count: int) -> list[tuple[str, str]]:
        tasks = self.sample_tasks(rng, count)
        if role == "sender":
            return [(self.render_prompt("sender", t, []), t["colour"]) for t in tasks]
        return [(self.render_prompt("receiver", t, [Turn("sender", t["colour"])]), t["colour"]) for t in tasks]
