"""CPU demo environment: a solver answers a small addition, a verifier judges the solver's answer.

Small enough that a 2-layer model learns it on a CPU within minutes, yet a real two-agent workflow:
the verifier's prompt contains the solver's turn, and each agent is scored on its own action
(the solver for a correct sum, the verifier for a correct verdict).

Warm-up examples come from a teacher that knows a fixed share of the questions (``warmup_known_share``,
chosen by a hash of the question, the same in every run) and guesses uniformly on the others; on those it
knows it is right with probability ``warmup_accuracy``. The base policies learn the format and the known
part of the table, and stay unsure on the rest: RL then finds the answers there by sampling, which a
held-out greedy evaluation sees. A teacher that is merely noisy everywhere (the first design) left
version 0 either already right on every question, with nothing for RL to improve in a greedy evaluation,
or, with a faster warm-up, not yet adding at all (0.14 held-out accuracy): which one depended on the
warm-up's data order.

Decoys keep the verifier honest. Judging only the solver's answers, a verifier sees ever fewer wrong ones
as the solver learns, and "yes" to everything earns it the solver's accuracy while its skill (telling
right from wrong) falls: that is what the first version of this demo trained. Decoys alone tip it the other
way: while the solver is weak, a verifier shown decoys and the solver's (mostly wrong) answers earns 0.9 by
always saying "no" (measured). So on a share of the tasks, drawn with the task, the verifier is shown a
wrong "decoy" answer (``decoy_share``) or the right sum (``right_share``) instead of the solver's, and the
kinds it sees stay balanced whatever the solver does. The solver's reward is unchanged; the verifier is
rewarded for a right verdict on what it was shown, weighted by its class (``yes_weight``, ``no_weight``): a
class-balanced reward when the weights are in the inverse ratio of the classes' shares.
"""

from __future__ import annotations

import zlib

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from marl_pipeline.environment import ActionResult, EvaluationCase, Task, Turn, accepted_majority


class ArithmeticOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    max_operand: int = Field(3, ge=1, le=99)
    """Operands are drawn uniformly from 0..max_operand."""
    warmup_accuracy: float = Field(0.3, ge=0, le=1)
    """Share of warm-up examples the noisy teacher gets right, on the questions it knows."""
    warmup_known_share: float = Field(1.0, ge=0, le=1)
    """Share of questions the warm-up teacher knows (a fixed set, by a hash of the question); on the others
    it answers at random, so version 0 is unsure there and RL has something to find."""
    decoy_share: float = Field(1 / 3, ge=0, le=1)
    """Share of tasks on which the verifier is shown a wrong decoy answer instead of the solver's."""
    right_share: float = Field(1 / 3, ge=0, le=1)
    """Share of tasks on which the verifier is shown the right sum instead of the solver's answer (with
    ``decoy_share`` 0 too, it always judges the solver)."""
    yes_weight: float = Field(1.0, gt=0, le=1)
    """The verifier's reward for a right "yes" (the answer shown is right); a wrong or unparsable verdict earns 0."""
    no_weight: float = Field(1.0, gt=0, le=1)
    """The verifier's reward for a right "no". Weights in the inverse ratio of the verdicts' shares make the reward
    class-balanced: a verdict given to every prompt then earns the same whichever it is (docs/environments.md, "When
    a verifier collapses", on which advantage estimators keep it)."""

    @model_validator(mode="after")
    def validate_shares(self) -> ArithmeticOptions:
        if self.decoy_share + self.right_share > 1:
            raise ValueError(f"decoy_share + right_share = {self.decoy_share + self.right_share:g} > 1")
        return self


class ArithmeticCheck:
    """Solver + verifier on ``a+b``."""

    name = "arithmetic_check"
    turn_order = ("solver", "verifier")
    Options = ArithmeticOptions

    def __init__(self, options: ArithmeticOptions) -> None:
        self.options = options

    # -- episodes ---------------------------------------------------------------------------------
    def sample_tasks(self, rng: np.random.Generator, count: int) -> list[Task]:
        operands = rng.integers(0, self.options.max_operand + 1, size=(count, 2))
        # Drawn after the operands, so the tasks' sums are the same whatever the shares.
        draws = rng.random(count)
        offsets = rng.integers(1, 2 * self.options.max_operand + 1, size=count)
        tasks = []
        for (a, b), draw, offset in zip(operands, draws, offsets):
            task = {"id": f"{a}+{b}", "a": int(a), "b": int(b)}
            if draw < self.options.decoy_share:  # a wrong sum in 0..2*max_operand: the right one shifted, wrapping
                task["shown"] = int((a + b + offset) % (2 * self.options.max_operand + 1))
            elif draw < self.options.decoy_share + self.options.right_share:
                task["shown"] = int(a + b)
            if "shown" in task:
                task["id"] += f"~{task['shown']}"
            tasks.append(task)
        return tasks

    def render_prompt(self, role: str, task: Task, transcript: list[Turn]) -> str:
        question = f"{task['a']}+{task['b']}="
        if role == "solver":
            return question
        if role == "verifier":
            return f"{question}{self._shown_answer(task, transcript)}?"
        raise ValueError(f"arithmetic_check has no role {role!r}")

    @staticmethod
    def _shown_answer(task: Task, transcript: list[Turn]) -> str:
        """What the verifier judges: the answer the task shows it (a decoy or the right sum), else the solver's."""
        return str(task["shown"]) if "shown" in task else _first_line(transcript[0].text)

    def execute(self, task: Task, transcript: list[Turn]) -> list[ActionResult]:
        expected = task["a"] + task["b"]
        solver = _solver_result(task, transcript[0].text)
        verdict = _first_line(transcript[1].text)
        shown = self._shown_answer(task, transcript)
        info = {"verdict": verdict, "shown": shown, "substituted": "shown" in task}
        if verdict not in ("yes", "no"):
            verifier = ActionResult("unparsable", False, info=info)
        else:
            truth = "yes" if _parse_int(shown) == expected else "no"
            verifier = ActionResult("right_verdict" if verdict == truth else "wrong_verdict", verdict == truth,
                                    info={**info, "truth": truth})
        return [solver, verifier]

    def score(self, task: Task, transcript: list[Turn], results: list[ActionResult]) -> dict[str, float]:
        verifier = results[1]
        weights = {"yes": self.options.yes_weight, "no": self.options.no_weight}
        weight = weights[verifier.info["truth"]] if verifier.success else 0.0
        return {"solver": float(results[0].success), "verifier": weight}

    # -- held-out evaluation ----------------------------------------------------------------------
    def evaluation_cases(self, role: str, rng: np.random.Generator, count: int) -> list[EvaluationCase]:
        """The solver gets additions; the verifier gets additions with a right answer in half the cases and a
        wrong one in the other half, so that its balanced accuracy is measured whatever the solver says."""
        cases = []
        for index, task in enumerate(map(_unsubstituted, self.sample_tasks(rng, count))):
            expected = task["a"] + task["b"]
            if role == "solver":
                cases.append(EvaluationCase(task, [], str(expected)))
                continue
            wrong = [n for n in range(2 * self.options.max_operand + 1) if n != expected]
            answer = expected if index % 2 == 0 else int(rng.choice(wrong))
            cases.append(EvaluationCase(task, [Turn("solver", str(answer))], "yes" if answer == expected else "no"))
        return cases

    def evaluate(self, role: str, cases: list[EvaluationCase], responses: list[str]) -> dict[str, float]:
        if role == "solver":
            right = [_parse_int(response) == int(case.label) for case, response in zip(cases, responses)]
            return {"accuracy": float(np.mean(right)) if right else 0.0}
        verdicts = [(case.label, self.answer_of(role, response)) for case, response in zip(cases, responses)]
        rates = {label: np.mean([verdict == label for truth, verdict in verdicts if truth == label])
                 for label in ("yes", "no") if any(truth == label for truth, _ in verdicts)}
        tpr, tnr = float(rates.get("yes", 0.0)), float(rates.get("no", 0.0))
        return {"balanced_accuracy": (tpr + tnr) / 2, "true_positive_rate": tpr, "true_negative_rate": tnr}

    def answer_of(self, role: str, response: str) -> str:
        return _first_line(response)

    def team_choice(self, task: Task, episodes: list[list[Turn]]) -> int:
        """The team's answer: the solver's answer its verifier accepts most often among the episodes."""
        return accepted_majority([self.answer_of("solver", episode[0].text) for episode in episodes],
                                 [self.answer_of("verifier", episode[1].text) == "yes" for episode in episodes])

    # -- base policies ----------------------------------------------------------------------------
    def text_corpus(self, rng: np.random.Generator, count: int) -> list[str]:
        corpus = []
        for role in ("solver", "verifier"):
            corpus += [prompt + completion for prompt, completion in self.warmup_examples(role, rng, count)]
        return corpus

    def warmup_examples(self, role: str, rng: np.random.Generator, count: int) -> list[tuple[str, str]]:
        top = 2 * self.options.max_operand
        examples = []
        for task in self.sample_tasks(rng, count):
            expected = task["a"] + task["b"]
            right = rng.random() < self.options.warmup_accuracy and self._teacher_knows(f"{task['a']}+{task['b']}")
            answer = expected if right else int(rng.integers(0, top + 1))
            solver_turn = Turn("solver", str(answer))
            if role == "solver":
                examples.append((self.render_prompt("solver", task, []), solver_turn.text))
                continue
            shown = self._shown_answer(task, [solver_turn])
            truth = "yes" if _parse_int(shown) == expected else "no"
            question = f"{task['a']}+{task['b']}={shown}"
            right = rng.random() < self.options.warmup_accuracy and self._teacher_knows(question)
            verdict = truth if right else str(rng.choice(["yes", "no"]))
            examples.append((self.render_prompt("verifier", task, [solver_turn]), verdict))
        return examples

    def _teacher_knows(self, question: str) -> bool:
        return zlib.crc32(question.encode()) / 2**32 < self.options.warmup_known_share

    def reward_examples(self, rng: np.random.Generator, count: int) -> list[tuple[str, str, float]]:
        """(prompt, response, label) for the built-in reward model: half right answers and verdicts, half wrong."""
        top = 2 * self.options.max_operand
        examples = []
        for task in map(_unsubstituted, self.sample_tasks(rng, count)):
            expected = task["a"] + task["b"]
            answer = expected if rng.random() < 0.5 else int(rng.choice([n for n in range(top + 1) if n != expected]))
            examples.append((self.render_prompt("solver", task, []), str(answer), float(answer == expected)))
            verdict = str(rng.choice(["yes", "no"]))
            prompt = self.render_prompt("verifier", task, [Turn("solver", str(answer))])
            examples.append((prompt, verdict, float((verdict == "yes") == (answer == expected))))
        return examples


class ArithmeticSolo(ArithmeticCheck):
    """The solver of ``arithmetic_check`` alone, with its tasks, reward, warm-up and held-out cases: the single-agent
    baseline that says what the verifier adds (bench/learning/seeds.py over both configs)."""

    name = "arithmetic_solo"
    turn_order = ("solver",)
    team_choice = None  # a team of one has no answer to choose

    def execute(self, task: Task, transcript: list[Turn]) -> list[ActionResult]:
        return [_solver_result(task, transcript[0].text)]

    def score(self, task: Task, transcript: list[Turn], results: list[ActionResult]) -> dict[str, float]:
        return {"solver": float(results[0].success)}


def _solver_result(task: Task, text: str) -> ActionResult:
    expected = task["a"] + task["b"]
    answer = _parse_int(text)
    if answer is None:
        return ActionResult("unparsable", False, info={"expected": expected})
    return ActionResult("correct" if answer == expected else "wrong", answer == expected,
                        info={"answer": answer, "expected": expected})


def _unsubstituted(task: Task) -> Task:
    """``task`` without a shown answer, for examples whose label is about the answer they pass in themselves."""
    return {"id": f"{task['a']}+{task['b']}", "a": task["a"], "b": task["b"]}


def _first_line(text: str) -> str:
    return text.strip().split("\n", 1)[0].strip()


def _parse_int(text: str) -> int | None:
    token = _first_line(text)
    return int(token) if token.isdigit() and len(token) <= 6 else None
