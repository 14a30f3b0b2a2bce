"""Math with chat prompts: a solver answers, a verifier says whether an answer is right (``math_chat``).

Turns: solver (an answer), verifier (``yes`` or ``no`` on the answer it is shown). Both are prompted with chat
messages, which the agent's own tokenizer renders with its chat template (``prompt_format: text`` gives plain
strings instead, for the built-in tiny model, which has no template).

Tasks: procedural additions (``What is a + b?``), or any reasoning-gym dataset by name (``math_tasks.py``).
Grading: math-verify for plain-number answers, the dataset's own ``score_answer`` for the others
(``checker``; ``math_answers.py`` says how math-verify is guarded).

Keeping the verifier honest: a verifier that always says ``yes`` would earn the solver's accuracy while its skill
falls, and a solver that is mostly wrong (or mostly right) shows it one kind of answer only. So, per task and
decided in ``sample_tasks``, with probability ``decoy_share`` the verifier is shown a wrong "decoy" answer instead
of the solver's. It is rewarded for a right verdict on what it was shown; the solver's reward never depends on it.

``shown_answers: balanced`` goes further: the episodes of a task's group alternate between a right and a wrong
answer shown to the verifier (``episode_task``), the solver's own whenever it is of that kind, the right answer or
a decoy otherwise. Shares drift as the solver learns (mostly wrong answers at first, mostly right ones later), and
GRPO follows the drift: the verifier's verdicts collapse to the common one, after which every group agrees and
carries no signal (configs/smollm2_arithmetic.yaml, BENCHMARKS.md). Balanced within each group, "yes" and "no"
each pay half the time whatever the solver does, so only telling them apart pays.
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from environments.math_answers import answer_text, check_math, is_plain_number, normalized_answer, verdict_of
from environments.math_tasks import AdditionSource, ReasoningGymSource
from marl_pipeline.config import PoolSettings
from marl_pipeline.environment import Action, ActionResult, EvaluationCase, Task, Turn, accepted_majority

Message = dict[str, str]

NUMBER_INSTRUCTION = "Reply with just the number."
ANSWER_INSTRUCTION = "Reply with just the answer."
# Wordings chosen by SmolLM2-135M-Instruct's base answers (docs/environments.md): it answers "Reply yes or no" with
# an equation, "Start your reply with Yes or No" with a verdict.
VERIFIER_TEMPLATE = ("{question}\nProposed answer: {shown}\n"
                     "Is the proposed answer correct? Start your reply with Yes or No.")


class MathChatOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    tasks: Literal["addition", "reasoning_gym"] = "addition"
    """``addition``: ``What is a + b?`` over ``a_range`` x ``b_range``; ``reasoning_gym``: the dataset ``dataset``."""
    a_range: tuple[int, int] = (10, 29)
    """Smallest and largest first addend (inclusive)."""
    b_range: tuple[int, int] = (3, 6)
    """Smallest and largest second addend (inclusive)."""
    dataset: str | None = None
    """A reasoning-gym dataset name (``chain_sum``, ``gcd``, ``leg_counting``, ...), for ``tasks: reasoning_gym``."""
    dataset_config: dict[str, Any] = Field(default_factory=dict)
    """That dataset's own config fields (e.g. ``{min_terms: 2, max_terms: 2}``), except seed and size."""
    dataset_seed: int = 0
    """The dataset's seed: with an index it fixes an entry."""
    dataset_size: int = Field(10_000, ge=1)
    """Indices drawn from 0..dataset_size-1."""
    checker: Literal["auto", "math_verify", "score_answer"] = "auto"
    """``auto``: math-verify where the right answer is a plain number, the dataset's ``score_answer`` elsewhere;
    or one of the two for every task (``score_answer`` needs a reasoning-gym dataset)."""
    decoy_share: float = Field(0.5, ge=0, le=1)
    """Share of tasks whose verifier is shown a wrong decoy answer instead of the solver's."""
    shown_answers: Literal["shares", "balanced"] = "shares"
    """``shares``: the verifier sees a decoy (``decoy_share``), the right answer (``right_share``) or the solver's
    answer; ``balanced``: a right or a wrong answer, alternating within each group (``episode_task``), the
    solver's own whenever it is of the episode's kind."""
    right_share: float = Field(0.0, ge=0, le=1)
    """Share of tasks whose verifier is shown the right answer instead of the solver's. With a weak solver,
    decoys alone make "no" right on nearly every task: shown right answers keep the verdicts balanced
    (configs/smollm2_arithmetic.yaml shows a third of each)."""
    heldout_share: float = Field(0.2, gt=0, lt=1)
    """Share of questions kept for held-out evaluation and never trained on (by a hash of the question)."""
    prompt_format: Literal["chat", "text"] = "chat"
    """``chat``: lists of messages for the agent's chat template; ``text``: plain strings (the built-in tiny model)."""
    system_prompt: str | None = None
    """A system message before the question (chat only); None: none, so the chat template's default applies."""
    warmup_accuracy: float = Field(0.5, ge=0, le=1)
    """Share of warm-up examples the noisy teacher gets right (the built-in tiny model's warm-up only)."""

    @model_validator(mode="after")
    def validate_source(self) -> MathChatOptions:
        if self.shown_answers == "balanced" and {"decoy_share", "right_share"} & self.model_fields_set:
            raise ValueError("shown_answers: balanced draws right and wrong answers half each: "
                             "drop decoy_share and right_share")
        if self.decoy_share + self.right_share > 1:
            raise ValueError(f"decoy_share + right_share = {self.decoy_share + self.right_share:g} > 1")
        for name, (low, high) in (("a_range", self.a_range), ("b_range", self.b_range)):
            if not 0 <= low <= high:
                raise ValueError(f"{name} {[low, high]}: expected 0 <= smallest <= largest")
        if self.tasks == "reasoning_gym":
            if not self.dataset:
                raise ValueError("tasks: reasoning_gym needs 'dataset', a reasoning-gym dataset name")
            clashing = sorted({"seed", "size"} & set(self.dataset_config))
            if clashing:
                raise ValueError(f"dataset_config sets {clashing}: use dataset_seed and dataset_size instead")
            _source(self)  # fail at config load for an unknown dataset or a config it rejects
        elif self.dataset or self.dataset_config:
            raise ValueError("'dataset' and 'dataset_config' are for tasks: reasoning_gym")
        elif self.checker == "score_answer":
            raise ValueError("checker score_answer needs tasks: reasoning_gym (additions have no dataset scorer)")
        return self


def _source(options: MathChatOptions) -> AdditionSource | ReasoningGymSource:
    if options.tasks == "addition":
        return AdditionSource(options.a_range, options.b_range, options.heldout_share)
    return ReasoningGymSource(options.dataset, options.dataset_config, options.dataset_seed, options.dataset_size,
                              options.heldout_share)


class MathChat:
    """Solver + verifier on math questions, prompted with chat messages."""

    name = "math_chat"
    turn_order = ("solver", "verifier")
    Options = MathChatOptions
    # Checks take about a millisecond: one worker keeps up, and a second covers a slow dataset scorer.
    pool_settings = PoolSettings(min_workers=1, max_workers=2, actions_per_worker=256, timeout_s=10.0)

    def __init__(self, options: MathChatOptions) -> None:
        self.options = options
        self.source = _source(options)

    # -- episodes ---------------------------------------------------------------------------------------------------
    def sample_tasks(self, rng: np.random.Generator, count: int) -> list[Task]:
        """Training questions; each carries its checker and its decoy (None: the verifier sees the solver's answer)."""
        tasks = []
        for task in self.source.draw(rng, count, heldout=False):
            if self.options.shown_answers == "balanced":
                # The kind drawn here is episode 0's; episode_task alternates it within the group and draws each
                # episode's wrong answer, so the task as drawn is its episode 0.
                drawn = {**task, "checker": self._checker_of(task), "decoy": None,
                         "shows_right": bool(rng.random() < 0.5), "episode_seed": int(rng.integers(2**31))}
                tasks.append(self.episode_task(drawn, 0))
                continue
            draw = rng.random()
            decoy = self.source.other_answer(task, rng) if draw < self.options.decoy_share else None
            shows_answer = self.options.decoy_share <= draw < self.options.decoy_share + self.options.right_share
            tasks.append({**task, "checker": self._checker_of(task), "decoy": decoy, "shows_answer": shows_answer})
        return tasks

    def episode_task(self, task: Task, trajectory: int) -> Task:
        """Balanced: the group's episodes alternate between a right and a wrong shown answer (from the task's drawn
        kind on), each wrong one drawn for its episode. One question, both kinds, in one GRPO group: the verdict's
        advantage then rewards telling them apart, and a constant verdict earns the group mean, zero advantage.
        Shares: every episode gets the task as drawn."""
        if "episode_seed" not in task:
            return task
        shows_right = task["shows_right"] != bool(trajectory % 2)
        rng = np.random.default_rng([task["episode_seed"], trajectory])
        return {**task, "shows_right": shows_right,
                "wrong_answer": None if shows_right else self.source.other_answer(task, rng)}

    def render_prompt(self, role: str, task: Task, transcript: list[Turn]) -> list[Message] | str:
        messages = self._messages(role, task, transcript)
        return messages if self.options.prompt_format == "chat" else _as_text(messages)

    def shown_answer(self, task: Task, transcript: list[Turn]) -> str:
        """What the verifier is shown: the task's decoy or its right answer, else the solver's answer (first line).
        Balanced: the solver's answer if it is right (wrong) as drawn, else the right answer (the drawn wrong one)."""
        if "shows_right" in task:
            solver = answer_text(transcript[0].text) if transcript else ""
            if solver and (self.grade(task, solver) >= 1) == task["shows_right"]:
                return solver
            return task["answer"] if task["shows_right"] else task["wrong_answer"] or "(no answer)"
        if task.get("shows_answer"):
            return task["answer"]
        return task.get("decoy") or answer_text(transcript[0].text) or "(no answer)"

    # -- actions: grading on the action pool (its timeout bounds a slow checker) ------------------------------------
    def actions(self, task: Task, transcript: list[Turn]) -> list[Action | None]:
        return [Action("answer", transcript[0].text, 0.1, {"task": task}),
                Action("verdict", transcript[1].text, 0.1,
                       {"task": task, "shown": self.shown_answer(task, transcript), "decoy": bool(task.get("decoy"))})]

    def run_action(self, action: Action) -> ActionResult:
        task = action.context["task"]
        if action.kind == "answer":
            score = self.grade(task, action.payload)
            outcome = "correct" if score >= 1 else "partly_correct" if score > 0 else "wrong"
            return ActionResult(outcome, score >= 1, info={"answer": answer_text(action.payload),
                                                           "expected": task["answer"], "score": score})
        if action.kind == "verdict":
            shown = action.context["shown"]
            shown_right = self.grade(task, shown) >= 1
            verdict = verdict_of(action.payload)
            info = {"verdict": verdict, "shown": shown, "decoy": action.context["decoy"], "shown_right": shown_right}
            if verdict is None:
                return ActionResult("unparsable", False, info={**info, "text": answer_text(action.payload)})
            right = (verdict == "yes") == shown_right
            return ActionResult("right_verdict" if right else "wrong_verdict", right, info=info)
        raise ValueError(f"{self.name}: unknown action kind {action.kind!r}")

    def execute(self, task: Task, transcript: list[Turn]) -> list[ActionResult]:
        return [self.run_action(action) for action in self.actions(task, transcript)]

    def score(self, task: Task, transcript: list[Turn], results: list[ActionResult]) -> dict[str, float]:
        """The solver's grade (1/0, or the dataset's partial credit) and the verifier's right verdict (1/0)."""
        return {"solver": float(results[0].info.get("score", 0.0)), "verifier": float(results[1].success)}

    def grade(self, task: Task, response: str) -> float:
        """``response``'s grade for ``task`` in [0, 1], by the task's checker."""
        if task.get("checker", self._checker_of(task)) == "math_verify":
            return float(check_math(task["answer"], response))
        return self.source.score_answer(task, answer_text(response))

    # -- held-out evaluation -----------------------------------------------------------------------------------------
    def evaluation_cases(self, role: str, rng: np.random.Generator, count: int) -> list[EvaluationCase]:
        """Held-out questions. The solver answers them; the verifier is shown the right answer in half the cases
        and a decoy in the other half, whatever the solver would say, so its balanced accuracy is measured."""
        cases = []
        for index, task in enumerate(self.source.draw(rng, count, heldout=True)):
            task = {**task, "checker": self._checker_of(task), "decoy": None}
            if role == "solver":
                cases.append(EvaluationCase(task, [], task["answer"]))
                continue
            shown = task["answer"] if index % 2 == 0 else self.source.other_answer(task, rng) or task["answer"]
            label = "yes" if self.grade(task, shown) >= 1 else "no"
            cases.append(EvaluationCase(task, [Turn("solver", shown)], label))
        return cases

    def evaluate(self, role: str, cases: list[EvaluationCase], responses: list[str]) -> dict[str, float]:
        if role == "solver":
            right = [self.grade(case.task, response) >= 1 for case, response in zip(cases, responses)]
            return {"accuracy": float(np.mean(right)) if right else 0.0}
        verdicts = [(case.label, verdict_of(response)) for case, response in zip(cases, responses)]
        rates = {label: float(np.mean([verdict == label for truth, verdict in verdicts if truth == label]))
                 for label in ("yes", "no") if any(truth == label for truth, _ in verdicts)}
        tpr, tnr = rates.get("yes", 0.0), rates.get("no", 0.0)
        unreadable = float(np.mean([verdict is None for _, verdict in verdicts])) if verdicts else 0.0
        return {"balanced_accuracy": (tpr + tnr) / 2, "true_positive_rate": tpr, "true_negative_rate": tnr,
                "readable_verdicts": 1.0 - unreadable}

    def answer_of(self, role: str, response: str) -> str:
        if role == "verifier":
            return verdict_of(response) or normalized_answer(response)
        return normalized_answer(response)

    def team_choice(self, task: Task, episodes: list[list[Turn]]) -> int:
        """The team's answer: the solver's answer its verifier's last verdict accepts most often among the episodes."""
        verdicts = [next(turn.text for turn in reversed(episode) if turn.role == "verifier") for episode in episodes]
        return accepted_majority([self.answer_of("solver", episode[0].text) for episode in episodes],
                                 [verdict_of(verdict) == "yes" for verdict in verdicts])

    # -- base policies (the built-in tiny model: plain-text prompts) -------------------------------------------------
    def text_corpus(self, rng: np.random.Generator, count: int) -> list[str]:
        return [p + c for role in ("solver", "verifier") for p, c in self.warmup_examples(role, rng, count)]

    def warmup_examples(self, role: str, rng: np.random.Generator, count: int) -> list[tuple[str, str]]:
        """A noisy teacher (right with probability ``warmup_accuracy``), on plain-text prompts whatever the
        prompt format: only a model without a chat template is warmed up here."""
        examples = []
        for task in self.sample_tasks(rng, count):
            right = rng.random() < self.options.warmup_accuracy
            answer = task["answer"] if right else self.source.other_answer(task, rng) or task["answer"]
            transcript = [Turn("solver", answer)]
            if role == "solver":
                examples.append((_as_text(self._messages("solver", task, [])), answer))
                continue
            truth = "yes" if self.grade(task, self.shown_answer(task, transcript)) >= 1 else "no"
            verdict = truth if rng.random() < self.options.warmup_accuracy else str(rng.choice(["yes", "no"]))
            examples.append((_as_text(self._messages("verifier", task, transcript)), verdict))
        return examples

    # -- helpers -----------------------------------------------------------------------------------------------------
    def _checker_of(self, task: Task) -> str:
        if self.options.checker != "auto":
            return self.options.checker
        return "math_verify" if is_plain_number(task["answer"]) else "score_answer"

    def _messages(self, role: str, task: Task, transcript: list[Turn]) -> list[Message]:
        if role == "solver":
            instruction = NUMBER_INSTRUCTION if is_plain_number(task["answer"]) else ANSWER_INSTRUCTION
            content = f"{task['question'].strip()} {instruction}"
        elif role == "verifier":
            content = VERIFIER_TEMPLATE.format(question=task["question"].strip(),
                                               shown=self.shown_answer(task, transcript))
        else:
            raise ValueError(f"{self.name} has no role {role!r}")
        system = [{"role": "system", "content": self.options.system_prompt}] if self.options.system_prompt else []
        return [*system, {"role": "user", "content": content}]


def _as_text(messages: list[Message]) -> str:
    """The plain-text prompt: the conversation's messages a line each, ending with a new line (no system message: a
    tiny model has no use for it); for one user message, that message and a new line."""
    return "".join(message["content"] + "\n" for message in messages if message["role"] != "system")
