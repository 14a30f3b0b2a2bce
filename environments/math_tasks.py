"""Where ``math_chat``'s tasks come from, and the split that keeps held-out questions out of training.

Two sources, one interface (``draw``, ``entry``, ``other_answer``):

- ``AdditionSource``: ``What is a + b?`` for every pair of the two ranges (a small space: 80 pairs by default);
- ``ReasoningGymSource``: any of reasoning-gym's procedural datasets by name, with its own config (entries are
  made from the dataset's seed and an index, so an index is all a task needs to carry to be scored again).

Held out means: the SHA-256 of the question text falls in the first ``heldout_share`` of 1000 buckets. Questions,
not ids, so that a question a dataset makes under two indices is held out under both; a hash, not the draw order,
so that every process (driver, action workers, a later launch) agrees without sharing state.
"""

from __future__ import annotations

import hashlib
import json
from functools import cache
from typing import Any

import numpy as np

from environments.math_answers import is_plain_number, near_miss
from marl_pipeline.environment import Task

_BUCKETS = 1000
_MAX_DRAWS_PER_TASK = 200
"""Rejection sampling gives up (with an error) after this many draws per wanted task."""
_NEAR_MISS_OFFSETS = (-10, -3, -2, -1, 1, 2, 3, 10)
"""How a decoy differs from a right plain-number answer: off by one to three, or a carry's ten."""


def is_heldout(question: str, share: float) -> bool:
    """Whether ``question`` belongs to the held-out evaluation questions (stable across processes)."""
    bucket = int.from_bytes(hashlib.sha256(question.encode("utf-8")).digest()[:4], "big") % _BUCKETS
    return bucket < round(share * _BUCKETS)


def numeric_decoy(answer: str, rng: np.random.Generator) -> str:
    """A wrong plain-number answer near the right one."""
    return near_miss(answer, int(rng.choice(_NEAR_MISS_OFFSETS)))


class AdditionSource:
    """``What is a + b?`` for a in ``a_range``, b in ``b_range`` (both inclusive)."""

    def __init__(self, a_range: tuple[int, int], b_range: tuple[int, int], heldout_share: float) -> None:
        tasks = [_addition(a, b) for a in range(a_range[0], a_range[1] + 1) for b in range(b_range[0], b_range[1] + 1)]
        self.train = [task for task in tasks if not is_heldout(task["question"], heldout_share)]
        self.heldout = [task for task in tasks if is_heldout(task["question"], heldout_share)]
        if not self.train or not self.heldout:
            raise ValueError(f"additions over a in {list(a_range)}, b in {list(b_range)} give {len(tasks)} questions, "
                             f"{len(self.heldout)} of them held out (heldout_share {heldout_share}): widen the ranges "
                             f"so that both training and held-out questions exist")

    def draw(self, rng: np.random.Generator, count: int, heldout: bool) -> list[Task]:
        """Training tasks with replacement; held-out ones each once before any repeats (the space is small)."""
        if not heldout:
            return [self.train[i] for i in rng.integers(0, len(self.train), size=count)]
        order = np.concatenate([rng.permutation(len(self.heldout)) for _ in range(-(-count // len(self.heldout)))])
        return [self.heldout[i] for i in order[:count]]

    def entry(self, task: Task) -> dict[str, Any]:
        return {"question": task["question"], "answer": task["answer"]}

    def other_answer(self, task: Task, rng: np.random.Generator) -> str | None:
        return numeric_decoy(task["answer"], rng)

    def score_answer(self, task: Task, answer: str) -> float:
        raise ValueError("additions are graded by math-verify; score_answer needs a reasoning-gym dataset")


def _addition(a: int, b: int) -> Task:
    return {"id": f"{a}+{b}", "question": f"What is {a} + {b}?", "answer": str(a + b)}


class ReasoningGymSource:
    """Tasks from ``reasoning_gym.create_dataset(name, seed=seed, size=size, **config)``.

    It holds only the dataset's key; the dataset object is made once per process (``_dataset``), so the action
    pool, which sends the plugin to its workers with each action, sends no dataset.
    """

    def __init__(self, name: str, config: dict[str, Any], seed: int, size: int, heldout_share: float) -> None:
        self.name, self.size, self.heldout_share = name, size, heldout_share
        self.key = (name, json.dumps(config, sort_keys=True), seed, size)
        self.dataset  # noqa: B018 - build it now, so that a bad name or config fails at once, not mid-run

    @property
    def dataset(self):
        return _dataset(*self.key)

    def draw(self, rng: np.random.Generator, count: int, heldout: bool) -> list[Task]:
        """Tasks on the wanted side of the split; held-out ones distinct while the draws find new ones."""
        tasks: list[Task] = []
        seen: set[str] = set()
        for _ in range(_MAX_DRAWS_PER_TASK * count):
            index = int(rng.integers(0, self.size))
            entry = self.dataset[index]
            if is_heldout(entry["question"], self.heldout_share) != heldout or (heldout and entry["question"] in seen):
                continue
            seen.add(entry["question"])
            tasks.append({"id": f"{self.name}#{index}", "index": index, "question": entry["question"],
                          "answer": str(entry["answer"])})
            if len(tasks) == count:
                return tasks
        if heldout and tasks:  # fewer distinct held-out questions than asked for: repeat them
            return [tasks[i % len(tasks)] for i in range(count)]
        side = "held-out" if heldout else "training"
        raise ValueError(f"reasoning-gym dataset {self.name!r}: found {len(tasks)} of {count} {side} questions in "
                         f"{_MAX_DRAWS_PER_TASK * count} draws; its questions are too few or too alike for "
                         f"heldout_share {self.heldout_share} (change the dataset's config or heldout_share)")

    def entry(self, task: Task) -> dict[str, Any]:
        return self.dataset[task["index"]]

    def other_answer(self, task: Task, rng: np.random.Generator) -> str | None:
        """A near miss for a plain-number answer, else another question's answer (None if 20 draws find only
        answers equal to this one)."""
        if is_plain_number(task["answer"]):
            return numeric_decoy(task["answer"], rng)
        for _ in range(20):
            other = str(self.dataset[int(rng.integers(0, self.size))]["answer"])
            if other.strip() != task["answer"].strip():
                return other
        return None

    def score_answer(self, task: Task, answer: str) -> float:
        """The dataset's own grade of ``answer``, in [0, 1]; 0 when its scorer fails on the model's text."""
        try:
            return float(self.dataset.score_answer(answer, entry=self.entry(task)))
        except Exception:  # a scorer that chokes on an odd answer has not been given a right one
            return 0.0


@cache
def _dataset(name: str, config_json: str, seed: int, size: int):
    """One reasoning-gym dataset object per process and configuration."""
    import reasoning_gym

    known = reasoning_gym.factory.DATASETS
    if name not in known:
        raise ValueError(f"unknown reasoning-gym dataset {name!r}; known: {', '.join(sorted(known))}")
    config = json.loads(config_json)
    try:
        return reasoning_gym.create_dataset(name, seed=seed, size=size, **config)
    except (TypeError, ValueError, AssertionError) as error:
        raise ValueError(f"reasoning-gym dataset {name!r} rejects its config {config}: {error}") from None
