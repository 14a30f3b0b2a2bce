"""A plugin written by following docs/environments.md only: a reasoning-gym dataset solved and checked by a team.

The ``solver`` answers a question of one of reasoning-gym's procedural datasets (``chain_sum`` by default: sums and
differences of small numbers); the ``checker`` sees the question and the solver's answer and says ``yes`` or
``no``. The dataset's own ``score_answer`` grades the solver (its reward); the checker earns 1 when its verdict
agrees with that grade. A task carries the entry's index, so every hook makes the entry again from the options.

An installable example (pyproject.toml beside this file): ``make plugin P=examples/gym_team``, then configs name
``docs_gym_team``. Scripts and tests register it in-process instead (``register_environment``).
"""

from __future__ import annotations

from functools import cached_property

import numpy as np
import reasoning_gym
from pydantic import BaseModel, ConfigDict, Field

from marl_pipeline.environment import ActionResult, Task, Turn


class GymOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    dataset: str = "chain_sum"
    """A reasoning-gym dataset's name."""
    dataset_config: dict = Field(default_factory=lambda: {"min_terms": 2, "max_terms": 2, "min_digits": 1,
                                                          "max_digits": 1})
    size: int = Field(500, ge=1)
    """Entries made from the dataset (seed 0); tasks draw from them."""


class GymTeam:
    name = "docs_gym_team"
    turn_order = ("solver", "checker")
    Options = GymOptions

    def __init__(self, options: GymOptions) -> None:
        self.options = options

    @cached_property
    def dataset(self):
        return reasoning_gym.create_dataset(self.options.dataset, seed=0, size=self.options.size,
                                            **self.options.dataset_config)

    def _entry(self, task: Task) -> dict:
        return self.dataset[task["index"]]

    def _question(self, task: Task) -> str:
        return self._entry(task)["question"].split(":")[-1].strip()  # "4 - 1 =": the tiny model's words are few

    def sample_tasks(self, rng: np.random.Generator, count: int) -> list[Task]:
        return [{"id": f"{self.options.dataset}-{index}", "index": index}
                for index in rng.integers(0, self.options.size, size=count).tolist()]

    def render_prompt(self, role: str, task: Task, transcript: list[Turn]) -> str:
        if role == "solver":
            return self._question(task)
        return f"{self._question(task)} {transcript[0].text.strip()[:12]} ok?"

    def _grade(self, task: Task, answer: str) -> float:
        return float(self.dataset.score_answer(answer.strip(), self._entry(task)) or 0.0)

    def execute(self, task: Task, transcript: list[Turn]) -> list[ActionResult]:
        grade = self._grade(task, transcript[0].text)
        verdict = transcript[1].text.strip().lower()
        agreed = verdict == ("yes" if grade == 1.0 else "no")
        return [ActionResult("right" if grade == 1.0 else "wrong", grade == 1.0, info={"grade": grade}),
                ActionResult("agreed" if agreed else "disagreed", agreed)]

    def score(self, task: Task, transcript: list[Turn], results: list[ActionResult]) -> dict[str, float]:
        return {"solver": results[0].info["grade"], "checker": float(results[1].success)}

    def text_corpus(self, rng: np.random.Generator, count: int) -> list[str]:
        return [p + " " + c for role in self.turn_order for p, c in self.warmup_examples(role, rng, count)]

    def warmup_examples(self, role: str, rng: np.random.Generator, count: int) -> list[tuple[str, str]]:
        tasks = self.sample_tasks(rng, count)
        if role == "solver":
            return [(self._question(t), self._entry(t)["answer"]) for t in tasks]
        shown = [self._entry(t)["answer"] if k % 2 else str(int(self._entry(t)["answer"]) + 1)
                 for k, t in enumerate(tasks)]  # right and off-by-one answers, half each
        return [(self.render_prompt("checker", t, [Turn("solver", answer)]), "yes" if k % 2 else "no")
                for k, (t, answer) in enumerate(zip(tasks, shown))]
