"""A task the roles split between them (``arithmetic_chain``): ``(a+b)*c``, an adder and a multiplier.

Turns: adder (``a+b=``: the sum), multiplier (``s*c=``, with ``s`` the adder's answer: the product). The multiplier
sees only its own step, as AT-GRPO's tool agent runs the plan it is given: the roles do different jobs, and neither
can do the other's. Each is rewarded for its own job on what it was given (the adder for the right sum, the
multiplier for the right product of the sum it was shown), and the team's answer is the multiplier's
(``answering_role``): the most frequent of its answers over the episodes of a case.

``arithmetic_chain_solo`` is the one agent doing the whole task (``(a+b)*c=``: the product, in one answer), with
the same tasks, the same kind of warm-up teacher and the same held-out cases, and its own majority over the same
number of episodes as its team answer: bench/learning/team.py's single arm (issue 72.4).

Warm-up, as the demo's (environments/arithmetic.py): a teacher that knows a fixed half of each table (by a hash of
the question) and guesses on the rest, so that version 0 knows the format and part of the answers and RL finds the
others by sampling. The adder's table has (max_operand + 1)^2 questions, the multiplier's (2 * max_operand + 1) x
max_factor, the one agent's (max_operand + 1)^2 x max_factor: the split is what the team has over one
agent, at the price of an error in either step spoiling the answer.

Held out (``heldout_share``): a fixed share of the whole questions is never trained on, nor shown in warm-up, and
the held-out cases ask only those. Every step of them is still trained (their sums and products come up in other
questions), so the team meets an unseen question as two seen steps, and the one agent as an unseen question.
"""

from __future__ import annotations

import zlib

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from marl_pipeline.environment import ActionResult, EvaluationCase, Task, Turn, accepted_majority


class ChainOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    max_operand: int = Field(3, ge=1, le=9)
    """``a`` and ``b`` are drawn uniformly from 0..max_operand."""
    max_factor: int = Field(3, ge=1, le=9)
    """``c`` is drawn uniformly from 1..max_factor: a factor of 0 would make "0" the right answer to a quarter of the
    questions whatever the sum, an answer a multiplier unsure of the rest settles on."""
    warmup_known_share: float = Field(0.5, ge=0, le=1)
    """Share of each table's questions the warm-up teacher answers right (a fixed set, by a hash of the question);
    on the others it guesses uniformly."""
    heldout_share: float = Field(0.0, ge=0, lt=1)
    """Share of the whole questions ``(a+b)*c`` kept out of training and warm-up (a fixed set, by a hash of the
    question) and asked only at held-out evaluation: unseen compositions of seen steps. 0: the held-out cases are
    fresh draws of the same questions as training's."""

    @model_validator(mode="after")
    def validate_split(self) -> ChainOptions:
        questions = [f"({a}+{b})*{c}" for a in range(self.max_operand + 1) for b in range(self.max_operand + 1)
                     for c in range(1, self.max_factor + 1)]
        held = sum(_held_out(question, self.heldout_share) for question in questions)
        if self.heldout_share > 0 and held in (0, len(questions)):
            raise ValueError(f"heldout_share {self.heldout_share:g} holds out {held} of the {len(questions)} "
                             f"questions: training and the held-out cases each need some; change it or the sizes")
        return self


class ArithmeticChain:
    """Adder + multiplier on ``(a+b)*c``."""

    name = "arithmetic_chain"
    turn_order = ("adder", "multiplier")
    answering_role = "multiplier"
    Options = ChainOptions

    def __init__(self, options: ChainOptions) -> None:
        self.options = options

    # -- episodes ---------------------------------------------------------------------------------
    def sample_tasks(self, rng: np.random.Generator, count: int) -> list[Task]:
        """Training's (and warm-up's) questions: any but the held-out ones."""
        return self._draw(rng, count, held_out=False)

    def _draw(self, rng: np.random.Generator, count: int, held_out: bool) -> list[Task]:
        tasks: list[Task] = []
        while len(tasks) < count:
            a, b = rng.integers(0, self.options.max_operand + 1, size=(2, count))
            c = rng.integers(1, self.options.max_factor + 1, size=count)
            drawn = [{"id": f"({x}+{y})*{z}", "a": int(x), "b": int(y), "c": int(z)} for x, y, z in zip(a, b, c)]
            tasks += [task for task in drawn if self._held_out(task) == held_out][:count - len(tasks)]
        return tasks

    def _held_out(self, task: Task) -> bool:
        return _held_out(task["id"], self.options.heldout_share)

    def render_prompt(self, role: str, task: Task, transcript: list[Turn]) -> str:
        if role == "adder":
            return f"{task['a']}+{task['b']}="
        if role == "multiplier":
            return f"{_shown_sum(transcript)}*{task['c']}="
        raise ValueError(f"{self.name} has no role {role!r}")

    def execute(self, task: Task, transcript: list[Turn]) -> list[ActionResult]:
        total = task["a"] + task["b"]
        added = _parse_int(transcript[0].text)
        shown = _parse_int(_shown_sum(transcript))
        product = _parse_int(transcript[1].text)
        # its own job on what it was shown; with nothing it could multiply, the team's answer
        expected = shown * task["c"] if shown is not None else total * task["c"]
        return [_graded(added, total),
                _graded(product, expected, team_right=product == total * task["c"])]

    def score(self, task: Task, transcript: list[Turn], results: list[ActionResult]) -> dict[str, float]:
        return {"adder": float(results[0].success), "multiplier": float(results[1].success)}

    # -- held-out evaluation ----------------------------------------------------------------------
    def evaluation_cases(self, role: str, rng: np.random.Generator, count: int) -> list[EvaluationCase]:
        """The adder's cases are labelled with the sum; the multiplier's with the product, given the right sum (its
        own skill), and they are the team's cases too: played whole, their answer is the product."""
        cases = []
        for task in self._draw(rng, count, held_out=self.options.heldout_share > 0):
            total = task["a"] + task["b"]
            if role == "adder":
                cases.append(EvaluationCase(task, [], str(total)))
            else:
                cases.append(EvaluationCase(task, [Turn("adder", str(total))], str(total * task["c"])))
        return cases

    def evaluate(self, role: str, cases: list[EvaluationCase], responses: list[str]) -> dict[str, float]:
        right = [_parse_int(response) == int(case.label) for case, response in zip(cases, responses)]
        return {"accuracy": float(np.mean(right)) if right else 0.0}

    def answer_of(self, role: str, response: str) -> str:
        return _first_line(response)

    def team_choice(self, task: Task, episodes: list[list[Turn]]) -> int:
        """The team's answer: the answering role's (the last turn's) most frequent answer among the episodes; for
        the one agent, its own, at the team's number of samples."""
        answers = [self.answer_of(self.answering_role, episode[-1].text) for episode in episodes]
        return accepted_majority(answers, [True] * len(answers))

    # -- base policies ----------------------------------------------------------------------------
    def text_corpus(self, rng: np.random.Generator, count: int) -> list[str]:
        return [prompt + completion for role in self.turn_order
                for prompt, completion in self.warmup_examples(role, rng, count)]

    def warmup_examples(self, role: str, rng: np.random.Generator, count: int) -> list[tuple[str, str]]:
        top_sum, top_product = 2 * self.options.max_operand, 2 * self.options.max_operand * self.options.max_factor
        examples = []
        for task in self.sample_tasks(rng, count):
            if role == "adder":
                prompt, right, top = self.render_prompt(role, task, []), task["a"] + task["b"], top_sum
            elif role == "multiplier":  # shown any sum the adder may give, not only the right one
                shown = int(rng.integers(0, top_sum + 1))
                prompt = self.render_prompt(role, task, [Turn("adder", str(shown))])
                right, top = shown * task["c"], top_product
            else:  # the one agent of arithmetic_chain_solo
                prompt = self.render_prompt(role, task, [])
                right, top = (task["a"] + task["b"]) * task["c"], top_product
            answer = right if self._teacher_knows(prompt) else int(rng.integers(0, top + 1))
            examples.append((prompt, str(answer)))
        return examples

    def _teacher_knows(self, question: str) -> bool:
        return zlib.crc32(question.encode()) / 2**32 < self.options.warmup_known_share


class ArithmeticChainSolo(ArithmeticChain):
    """One agent doing ``arithmetic_chain``'s whole task: ``(a+b)*c=`` answered with the product."""

    name = "arithmetic_chain_solo"
    turn_order = ("solver",)
    answering_role = "solver"

    def render_prompt(self, role: str, task: Task, transcript: list[Turn]) -> str:
        if role == "solver":
            return f"({task['a']}+{task['b']})*{task['c']}="
        raise ValueError(f"{self.name} has no role {role!r}")

    def execute(self, task: Task, transcript: list[Turn]) -> list[ActionResult]:
        expected = (task["a"] + task["b"]) * task["c"]
        return [_graded(_parse_int(transcript[0].text), expected)]

    def score(self, task: Task, transcript: list[Turn], results: list[ActionResult]) -> dict[str, float]:
        return {"solver": float(results[0].success)}

    def evaluation_cases(self, role: str, rng: np.random.Generator, count: int) -> list[EvaluationCase]:
        """The team's cases (the same tasks, drawn alike), labelled with the product."""
        return [EvaluationCase(task, [], str((task["a"] + task["b"]) * task["c"]))
                for task in self._draw(rng, count, held_out=self.options.heldout_share > 0)]


def _graded(answer: int | None, expected: int, **info) -> ActionResult:
    """A step's result: unparsable, correct or wrong against ``expected``."""
    outcome = "unparsable" if answer is None else "correct" if answer == expected else "wrong"
    return ActionResult(outcome, answer == expected, info={"answer": answer, "expected": expected, **info})


def _held_out(question: str, share: float) -> bool:
    """Whether ``question`` (``(a+b)*c``) is among the fixed ``share`` never trained on."""
    return zlib.crc32(f"held out {question}".encode()) / 2**32 < share


def _shown_sum(transcript: list[Turn]) -> str:
    """The adder's answer as the multiplier is shown it: its first line, at most 4 characters."""
    return _first_line(transcript[0].text)[:4]


def _first_line(text: str) -> str:
    return text.strip().split("\n", 1)[0].strip()


def _parse_int(text: str) -> int | None:
    token = _first_line(text)
    return int(token) if token.isdigit() and len(token) <= 6 else None
