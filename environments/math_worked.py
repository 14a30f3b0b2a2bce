"""Math with a verifier that works the question out before it judges (``math_chat_worked``).

Turns: solver (an answer), verifier (its own answer to the same question: its working), verifier again (``yes`` or
``no``: is the answer it is now shown the same as its own?). Everything else is ``math_chat``'s: chat prompts,
math-verify or reasoning-gym grading, the held-out split.

Why: a verifier asked for a verdict first must do, in its first token, the addition the solver needs a sentence
for. SmolLM2-135M cannot, and RL on the verdict alone did not teach it in 25 steps: "Yes" to everything, then "No"
to everything, balanced accuracy 0.5 (BENCHMARKS.md). Checking by working it out splits the skill in two that a
small model can learn: the working, which RL teaches a solver, and a comparison of two answers in its context.

Reward, per turn (``turn_credit``, the default, through the ``score_turns`` hook): the working earns its grade, the
verdict earns 1 when it agrees with the working, saying ``yes`` exactly when the shown answer is the verifier's own.
Each turn is compared with the same turn of its group, so neither signal carries the other's noise: with one
episode reward for both turns (``turn_credit: false``, ``w * working's grade + (1 - w) * agreement``, w =
``working_weight``), the working of a SmolLM2 verifier was right on 0-6% of samples over 8 steps while the
solver's, on the same question with its grade alone, rose to 12% (BENCHMARKS.md). The working is graded
against the true answer, so it pays only for being right, and it comes before any answer is shown, so it cannot
copy one. The verdict pays for following from the working, a signal in every episode from the first step: a
verdict paid for being right carries none while the working is wrong, since "yes" to a right answer the verifier
itself got wrong cannot follow from anything it wrote.

What it is shown (``shown_answers: working``, the default here): the episodes of a group alternate between its own
answer (what math-verify reads from its working, else the working's first line) and another one: the solver's if
it is a number and differs, else the right answer or a near miss. Then "same" and "different" are half each, and a
constant verdict earns zero advantage, however good the working is. (Shown right and wrong answers half each,
``balanced``, would make "same" as rare as a right working: 2% of episodes for the base model, too few to learn
the comparison from.) Skill is measured, not assumed: on held-out questions the verifier works the question out,
is shown the right answer or a near miss half each, and its verdicts are graded against the truth
(``balanced_accuracy``), next to ``working_accuracy`` and ``agreement``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Literal

import numpy as np
from pydantic import Field

from environments.math_answers import answer_text, is_plain_number, same_answer, stated_answer, verdict_of
from environments.math_chat import MathChat, MathChatOptions, Message, _as_text
from marl_pipeline.environment import Action, ActionResult, EvaluationCase, Rehearsal, Task, Turn

# The verdict turn's user message; its first turn is the solver's question (math_chat.NUMBER_INSTRUCTION). Asked
# "Is the proposed answer correct?" after its working, base SmolLM2-135M says "Yes" greedy to 87-100% of answers;
# asked whether another answer is the same as its own, its greedy verdicts are mixed (docs/environments.md).
VERDICT_TEMPLATE = "Another answer: {shown}\nIs it the same as your answer? Start your reply with Yes or No."
# ``quote_own_answer``: its own stated answer quoted back beside the shown one. Base SmolLM2-135M finds no answer
# in its own reply: P(yes) was 0.28 whether the shown answer was its own or not, and 0.52 vs 0.48 even asked "Is
# 34 equal to 34?" (T=1, 640 verdicts each, docs/environments.md); quoted, the comparison is within one line.
QUOTED_VERDICT_TEMPLATE = "Is {shown} equal to {own}? Start your reply with Yes or No."


class MathChatWorkedOptions(MathChatOptions):
    shown_answers: Literal["shares", "balanced", "working"] = "working"
    """``working``: the verifier's own answer or another, alternating within each group; ``balanced`` and
    ``shares`` as in ``math_chat``."""
    turn_credit: bool = True
    """Each verifier turn learns from its own reward (``score_turns``): the working from its grade, the verdict
    from agreeing with the working. False: both turns get the episode's ``working_weight`` mix."""
    quote_own_answer: bool = False
    """The verdict turn quotes the verifier's own stated answer (math-verify's reading of its working) beside the
    shown one ("Is 35 equal to 34?"), instead of asking whether the shown one is the same as its answer."""
    warmup_turns: Literal["both", "verdict"] = "both"
    """What the verifier's supervised warm-up teaches. ``both`` (the built-in tiny model): its working from the
    noisy teacher and its verdicts on it, on plain text. ``verdict``: the comparison alone, a cold start for a chat
    model: chat prompts (its working, the noisy teacher's answer, in context only), every verdict labelled by
    whether the shown answer is the same as the working's; no working is trained, so no sum is taught."""
    rehearse_working: float = Field(0.5, ge=0, lt=1)
    """``warmup_turns: verdict``: the share of warm-up examples that rehearse the verifier's own working (its reply
    to the question, sampled before warm-up) instead of teaching a verdict. With none, 30 steps on "Yes"/"No" made
    SmolLM2-135M answer "No" to the question too: held-out working accuracy 0.00 (BENCHMARKS.md)."""
    rehearse_right_of: int = Field(0, ge=0)
    """``warmup_turns: verdict``: for each rehearsed question, sample this many of the verifier's own workings and
    hold a right one where there is one (a ``Rehearsal``), else a sampled one as before. The KL along one sampled
    working a question held SmolLM2's greedy working but not its right answers at temperature 1 (3.5% -> 1.5%).
    With 8 tries (and the since-removed ``rehearse_context``), RL's working was right in 6 of 336 samples over 7
    steps, against 0-1 without and 15 for the solver, but agreed less with its verdicts (BENCHMARKS.md); off by
    default."""
    verdict_weight: float = Field(1.0, ge=0)
    """``turn_credit``: the verdict turn's advantages scaled by this (``turn_weights``). Both verifier turns train
    one set of weights with one AdamW: after a cold start for the comparison, the verdict has advantages in most
    groups every step, the working in one or two a step, and the verdict's gradients set the size of every update
    (BENCHMARKS.md). Below 1 a right working weighs more against the verdict in each update. Measured after the
    cold start on seed 0 it changed nothing: the working was right in 1 of 768 samples, so it had no advantage to
    weigh up. 0: the verdict is not trained in RL; it keeps its cold start (``warmup.adapter``), and RL's adapters,
    which it shares with the working, move it only as the working's training does."""
    working_weight: float = Field(0.5, ge=0, le=1)
    """Share of the verifier's episode reward paid for its working being right; the rest pays a verdict that agrees
    with its working."""


class MathChatWorked(MathChat):
    """Solver + a verifier that answers the question itself, then judges the shown answer against its own."""

    name = "math_chat_worked"
    turn_order = ("solver", "verifier", "verifier")
    Options = MathChatWorkedOptions

    # -- episodes ---------------------------------------------------------------------------------------------------
    def sample_tasks(self, rng: np.random.Generator, count: int) -> list[Task]:
        """``working``: each question with the kind its episode 0 is shown (its own answer or another) and a seed
        for each episode's near miss; other modes as in ``math_chat``."""
        if self.options.shown_answers != "working":
            return super().sample_tasks(rng, count)
        return [self.episode_task({**task, "checker": self._checker_of(task), "decoy": None,
                                   "shows_own": bool(rng.random() < 0.5), "episode_seed": int(rng.integers(2**31))}, 0)
                for task in self.source.draw(rng, count, heldout=False)]

    def episode_task(self, task: Task, trajectory: int) -> Task:
        """``working``: a group's episodes alternate between being shown the verifier's own answer and another,
        each with its own near miss for when no other answer differs from the verifier's."""
        if "shows_own" not in task:
            return super().episode_task(task, trajectory)
        rng = np.random.default_rng([task["episode_seed"], trajectory])
        return {**task, "shows_own": task["shows_own"] != bool(trajectory % 2),
                "wrong_answer": self.source.other_answer(task, rng)}

    def shown_answer(self, task: Task, transcript: list[Turn]) -> str:
        """``working``: the verifier's own answer (as math-verify reads it from its working, else the working's
        first line) on a ``shows_own`` episode whose working is not empty; else the first of the solver's answer
        (read the same way, if a number), the right answer and the episode's near miss that is not the verifier's.
        Other modes, and held-out cases, as in ``math_chat``."""
        if "shows_own" not in task:
            return super().shown_answer(task, transcript)
        working = next((turn.text for turn in transcript if turn.role == "verifier"), "")
        own = stated_answer(working)
        # Its own answer even where it is words: "same" must stay half of a group's verdicts. Shown only numbers,
        # a base verifier's many wordy workings made "different" two thirds of them, and its verdicts fell to "No"
        # (P(yes) 0.00-0.11 by step 9, BENCHMARKS.md).
        if task["shows_own"] and own is not None:
            return own
        # The solver's answer as stated, like the verifier's own: shown as the solver wrote it ("28 + 6 equals 34.")
        # next to its own as a bare number, the form alone would tell "other" from "own".
        solver = stated_answer(transcript[0].text) if transcript else None
        if solver is not None and is_plain_number(task["answer"]) and not is_plain_number(solver):
            solver = None  # a number was asked for: another answer is one
        for candidate in (solver, task["answer"], task["wrong_answer"]):
            if candidate and not same_answer(working, candidate):
                return candidate
        return task["wrong_answer"] or "(no answer)"

    def _messages(self, role: str, task: Task, transcript: list[Turn]) -> list[Message]:
        if role != "verifier":
            return super()._messages(role, task, transcript)
        question = super()._messages("solver", task, [])
        working = [turn for turn in transcript if turn.role == "verifier"]
        if not working:
            return question
        shown = self.shown_answer(task, transcript)
        ask = (QUOTED_VERDICT_TEMPLATE.format(shown=shown, own=stated_answer(working[0].text) or "(no answer)")
               if self.options.quote_own_answer else VERDICT_TEMPLATE.format(shown=shown))
        return [*question, {"role": "assistant", "content": working[0].text}, {"role": "user", "content": ask}]

    # -- actions and rewards -----------------------------------------------------------------------------------------
    def actions(self, task: Task, transcript: list[Turn]) -> list[Action | None]:
        solver, working, verdict = transcript[0], transcript[1], transcript[2]
        return [Action("answer", solver.text, 0.1, {"task": task}),
                Action("answer", working.text, 0.1, {"task": task}),
                Action("verdict", verdict.text, 0.1, {"task": task, "shown": self.shown_answer(task, transcript),
                                                      "decoy": bool(task.get("decoy")), "working": working.text})]

    def run_action(self, action: Action) -> ActionResult:
        result = super().run_action(action)
        if action.kind != "verdict":
            return result
        matches = same_answer(action.context["working"], action.context["shown"])
        verdict = result.info["verdict"]
        agrees = verdict is not None and (verdict == "yes") == matches
        return replace(result, info={**result.info, "working": answer_text(action.context["working"]),
                                     "working_matches": matches, "agrees_with_working": agrees})

    def score(self, task: Task, transcript: list[Turn], results: list[ActionResult]) -> dict[str, float]:
        """The solver's grade; the verifier's ``w * working's grade + (1 - w) * verdict agrees with the working``."""
        weight = self.options.working_weight
        working = float(results[1].info.get("score", 0.0))
        agrees = float(bool(results[2].info.get("agrees_with_working", False)))
        return {"solver": float(results[0].info.get("score", 0.0)),
                "verifier": weight * working + (1 - weight) * agrees}

    def score_turns(self, task: Task, transcript: list[Turn], results: list[ActionResult]) -> list[float] | None:
        """``turn_credit``: each turn's own reward, the solver's grade, the working's grade, the verdict's agreement
        with the working (the reward stage then compares each turn with the same turn of the group's episodes)."""
        if not self.options.turn_credit:
            return None
        return [float(results[0].info.get("score", 0.0)), float(results[1].info.get("score", 0.0)),
                float(bool(results[2].info.get("agrees_with_working", False)))]

    def turn_weights(self, task: Task, transcript: list[Turn]) -> list[float] | None:
        """``turn_credit``: the verdict's advantages weighted by ``verdict_weight``, the other turns' by 1."""
        if not self.options.turn_credit or self.options.verdict_weight == 1.0:
            return None
        return [1.0, 1.0, self.options.verdict_weight]

    # -- held-out evaluation: the verifier works each case out, then gives its verdict -------------------------------
    def evaluation_cases(self, role: str, rng: np.random.Generator, count: int) -> list[EvaluationCase]:
        cases = super().evaluation_cases(role, rng, count)
        return [replace(case, turns=2) for case in cases] if role == "verifier" else cases

    def evaluate(self, role: str, cases: list[EvaluationCase], responses: list[str]) -> dict[str, float]:
        """``math_chat``'s metrics (the verdicts against the truth); the verifier's also ``working_accuracy``, its
        own answers' accuracy, and ``agreement``, the share of verdicts that follow from them."""
        metrics = super().evaluate(role, cases, responses)
        if role != "verifier":
            return metrics
        workings = [next((t.text for t in case.transcript if t.role == "verifier"), "") for case in cases]
        shown = [next((t.text for t in case.transcript if t.role == "solver"), "") for case in cases]
        right = [self.grade(case.task, working) >= 1 for case, working in zip(cases, workings)]
        agrees = [verdict_of(response) == ("yes" if same_answer(working, answer) else "no")
                  for working, answer, response in zip(workings, shown, responses)]
        return {**metrics, "working_accuracy": float(np.mean(right)) if right else 0.0,
                "agreement": float(np.mean(agrees)) if agrees else 0.0}

    # -- warm-up: both verifier turns on plain text (the tiny model), or the verdict alone (a chat model) ---------
    def warmup_examples(self, role: str, rng: np.random.Generator,
                        count: int) -> list[tuple[str | list[Message], str]]:
        """``warmup_turns: both``: the verifier's pairs alternate, its working (the noisy teacher's answer) and its
        verdict on a shown answer given that working (agreeing with it with probability ``warmup_accuracy``).
        ``verdict``: verdicts on chat messages, each agreeing with the working, and (``rehearse_working``) the
        question with no completion: the verifier's own working rehearsed, so no sum is taught and none unlearned."""
        if role != "verifier":
            return super().warmup_examples(role, rng, count)
        if self.options.warmup_turns == "verdict":  # the noisy teacher's workings (own_reply_warmup_examples: its own)
            tasks = self.sample_tasks(rng, count)
            return self._verdict_examples(rng, tasks, rng.random(len(tasks)) < self.options.rehearse_working,
                                          lambda task: self._noisy_answer(task, rng))
        examples = []
        for index, task in enumerate(self.sample_tasks(rng, count)):
            working = self._noisy_answer(task, rng)
            if index % 2 == 0:
                examples.append((_as_text(self._messages("verifier", task, [])), working))
                continue
            transcript = [Turn("solver", self._noisy_answer(task, rng)), Turn("verifier", working)]
            agrees = "yes" if same_answer(working, self.shown_answer(task, transcript)) else "no"
            verdict = agrees if rng.random() < self.options.warmup_accuracy else str(rng.choice(["yes", "no"]))
            examples.append((_as_text(self._messages("verifier", task, transcript)), verdict))
        return examples

    def own_reply_warmup_examples(self, role: str, rng: np.random.Generator, count: int,
                                  replies: Callable[[list[list[Message]]], list[str]]):
        """``warmup_turns: verdict``: the verdict examples' workings are the verifier's own replies to the question
        (``replies``: sampled from it as rollout samples), so it learns to compare the answers it gives. On the
        noisy teacher's bare numbers instead, SmolLM2's held-out verdicts followed its own working 9% of the time,
        against 91% (bench/learning/verdict_cold_start.py, BENCHMARKS.md). Otherwise None: ``warmup_examples``."""
        if role != "verifier" or self.options.warmup_turns != "verdict":
            return None
        tasks = self.sample_tasks(rng, count)
        rehearsed = rng.random(len(tasks)) < self.options.rehearse_working
        taught = [task for task, rehearse in zip(tasks, rehearsed) if not rehearse]
        workings = iter(replies([self._messages("verifier", task, []) for task in taught]))
        examples = self._verdict_examples(rng, tasks, rehearsed, lambda task: next(workings))
        tries = self.options.rehearse_right_of
        if tries:
            held = [index for index, (_, completion) in enumerate(examples) if completion is None]
            sampled = replies([examples[index][0] for index in held for _ in range(tries)])
            for slot, index in enumerate(held):
                right = [w for w in sampled[slot * tries:(slot + 1) * tries] if self.grade(tasks[index], w) >= 1]
                if right:
                    examples[index] = (examples[index][0], Rehearsal(right[0]))
        return examples

    def _verdict_examples(self, rng: np.random.Generator, tasks: list[Task], rehearsed,
                          working_of: Callable[[Task], str]) -> list[tuple[list[Message], str | Rehearsal | None]]:
        examples: list[tuple[list[Message], str | Rehearsal | None]] = []
        for index, (task, rehearse) in enumerate(zip(tasks, rehearsed)):
            if rehearse:
                examples.append((self._messages("verifier", task, []), None))  # its own working, kept as it was
                continue
            working = working_of(task)
            transcript = [Turn("solver", self._noisy_answer(task, rng)), Turn("verifier", working)]
            episode = self.episode_task(task, index)  # own and other answers shown half each, as in rollout
            agrees = "Yes" if same_answer(working, self.shown_answer(episode, transcript)) else "No"
            examples.append((self._messages("verifier", episode, transcript), agrees))
        return examples

    def _noisy_answer(self, task: Task, rng: np.random.Generator) -> str:
        right = rng.random() < self.options.warmup_accuracy
        return task["answer"] if right else self.source.other_answer(task, rng) or task["answer"]


class MathChatSolo(MathChatWorked):
    """The solver of ``math_chat_worked`` alone, with its options, tasks, grading and held-out cases: the
    single-agent baseline that says what the verifier adds (``configs/smollm2_solver_alone.yaml``)."""

    name = "math_chat_solo"
    turn_order = ("solver",)
    team_choice = None  # a team of one has no answer to choose

    def actions(self, task: Task, transcript: list[Turn]) -> list[Action | None]:
        return [Action("answer", transcript[0].text, 0.1, {"task": task})]

    def score(self, task: Task, transcript: list[Turn], results: list[ActionResult]) -> dict[str, float]:
        return {"solver": float(results[0].info.get("score", 0.0))}

    def score_turns(self, task: Task, transcript: list[Turn], results: list[ActionResult]) -> list[float] | None:
        return None

    def turn_weights(self, task: Task, transcript: list[Turn]) -> list[float] | None:
        return None
