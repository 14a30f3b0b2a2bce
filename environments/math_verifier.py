"""Math solver-verifier: the solver answers, the verifier checks and critiques, the solver revises.

Turns: solver (answer) -> verifier (``correct`` or ``wrong``, then a critique) -> solver (final answer,
having seen the verifier's turn and the environment's reply to it: the verdict as the environment
reads it, ``observe``). The solver is rewarded for an exact-match final answer, the
verifier for a right verdict on the first answer; ``team_reward_weight`` mixes in the team's mean.

Tasks: procedurally generated arithmetic word problems, or a user's file (``task_file``: JSONL or
Parquet with ``question`` and ``answer`` columns; answers are integers).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator

from marl_pipeline.environment import Action, ActionResult, Task, Turn

_TEMPLATES = (
    ("{name} has {a} apples and gets {b} more. How many apples?", lambda a, b: a + b),
    ("{name} has {a} coins and spends {b}. How many coins are left?", lambda a, b: a - b),
    ("{name} packs {a} boxes of {b} pens. How many pens?", lambda a, b: a * b),
)
_NAMES = ("Ann", "Bo", "Cy", "Di")


class MathOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    max_operand: int = Field(9, ge=1, le=999)
    """Operands of generated problems are drawn from 0..max_operand (a subtraction never goes negative)."""
    task_file: str | None = None
    """JSONL or Parquet file of ``question``/``answer`` tasks; None: generated word problems."""
    team_reward_weight: float = Field(0.0, ge=0, le=1)
    """Credit assignment: 0 each agent's own reward, 1 the team's mean, in between a mix."""

    @field_validator("task_file")
    @classmethod
    def validate_task_file(cls, path: str | None) -> str | None:
        if path is not None:
            load_tasks(path)  # fail at config load, naming the file and what is wrong
        return path


def load_tasks(path: str | Path) -> list[Task]:
    """Read a task file (``.jsonl`` or ``.parquet``) with ``question`` and integer ``answer`` per row."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"task file not found: {path}")
    if path.suffix == ".jsonl":
        rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    elif path.suffix == ".parquet":
        import pyarrow.parquet as pq

        rows = pq.read_table(path).to_pylist()
    else:
        raise ValueError(f"task file {path}: expected a .jsonl or .parquet file")
    tasks = []
    for number, row in enumerate(rows, 1):
        missing = [key for key in ("question", "answer") if key not in row]
        if missing:
            raise ValueError(f"task file {path}, row {number}: missing {missing}")
        try:
            answer = int(str(row["answer"]).strip())
        except ValueError:
            raise ValueError(f"task file {path}, row {number}: answer {row['answer']!r} is not an integer") from None
        tasks.append({"id": str(row.get("id", f"t{number}")), "question": str(row["question"]), "answer": answer})
    if not tasks:
        raise ValueError(f"task file {path} holds no tasks")
    return tasks


class MathSolverVerifier:
    """Solver + verifier + solver revision on word problems."""

    name = "math_solver_verifier"
    turn_order = ("solver", "verifier", "solver")
    Options = MathOptions

    def __init__(self, options: MathOptions) -> None:
        self.options = options
        self.team_reward_weight = options.team_reward_weight
        self._file_tasks = load_tasks(options.task_file) if options.task_file else None

    def sample_tasks(self, rng: np.random.Generator, count: int) -> list[Task]:
        if self._file_tasks is not None:
            return [self._file_tasks[i] for i in rng.integers(0, len(self._file_tasks), size=count)]
        tasks = []
        for _ in range(count):
            kind = int(rng.integers(len(_TEMPLATES)))
            a, b = (int(x) for x in rng.integers(0, self.options.max_operand + 1, size=2))
            a, b = (max(a, b), min(a, b)) if kind == 1 else (a, b)
            template, solve = _TEMPLATES[kind]
            name = _NAMES[int(rng.integers(len(_NAMES)))]
            tasks.append({"id": f"{kind}-{a}-{b}", "question": template.format(name=name, a=a, b=b),
                          "answer": solve(a, b)})
        return tasks

    def render_prompt(self, role: str, task: Task, transcript: list[Turn]) -> str:
        prompt = f"Q: {task['question']}\nA: "
        if role == "solver" and not transcript:
            return prompt
        prompt += f"{_first_line(transcript[0].text)}\nCheck: "
        if role == "verifier":
            return prompt
        if role == "solver":
            reply = f"{transcript[1].observation}\n" if transcript[1].observation else ""
            return prompt + f"{_first_line(transcript[1].text)}\n{reply}Final: "
        raise ValueError(f"{self.name} has no role {role!r}")

    def observe(self, role: str, task: Task, transcript: list[Turn]) -> str | None:
        """The environment's reply to the verifier's turn, which the solver's revision sees: the verdict it reads."""
        if role != "verifier":
            return None
        verdict = _verdict_of(transcript[-1].text)
        return f"Verdict: {verdict or 'unreadable'}"

    # -- actions: each turn's answer or verdict is checked on the action pool ------------------------------------
    def actions(self, task: Task, transcript: list[Turn]) -> list[Action | None]:
        first = _parse_int(transcript[0].text)
        return [Action("answer", transcript[0].text, 0.1, {"expected": task["answer"]}),
                Action("verdict", transcript[1].text, 0.1,
                       {"first_answer_correct": first is not None and first == task["answer"]}),
                Action("answer", transcript[2].text, 0.1, {"expected": task["answer"]})]

    def run_action(self, action: Action) -> ActionResult:
        if action.kind == "answer":
            answer = _parse_int(action.payload)
            expected = action.context["expected"]
            if answer is None:
                return ActionResult("unparsable", False, info={"expected": expected})
            return ActionResult("correct" if answer == expected else "wrong", answer == expected,
                                info={"answer": answer, "expected": expected})
        if action.kind == "verdict":
            words = _first_line(action.payload).split(maxsplit=1)
            verdict = _verdict_of(action.payload)
            if verdict is None:
                return ActionResult("unparsable", False, info={"verdict": words[0].lower() if words else ""})
            right = (verdict == "correct") == action.context["first_answer_correct"]
            return ActionResult("right_verdict" if right else "wrong_verdict", right,
                                info={"verdict": verdict, "critique": words[1] if len(words) > 1 else ""})
        raise ValueError(f"{self.name}: unknown action kind {action.kind!r}")

    def execute(self, task: Task, transcript: list[Turn]) -> list[ActionResult]:
        return [self.run_action(a) for a in self.actions(task, transcript)]

    def score(self, task: Task, transcript: list[Turn], results: list[ActionResult]) -> dict[str, float]:
        return {"solver": float(results[2].success), "verifier": float(results[1].success)}

    # -- base policies ---------------------------------------------------------------------------------------------
    def text_corpus(self, rng: np.random.Generator, count: int) -> list[str]:
        return [p + c for role in ("solver", "verifier") for p, c in self.warmup_examples(role, rng, count)]

    def warmup_examples(self, role: str, rng: np.random.Generator, count: int) -> list[tuple[str, str]]:
        examples = []
        for task in self.sample_tasks(rng, count):
            answer = task["answer"] if rng.random() < 0.5 else task["answer"] + 1
            verdict = "correct" if answer == task["answer"] else "wrong"
            if role == "solver":
                examples.append((self.render_prompt("solver", task, []), str(answer)))
            else:
                examples.append((self.render_prompt("verifier", task, [Turn("solver", str(answer))]), verdict))
        return examples


    def reward_examples(self, rng: np.random.Generator, count: int) -> list[tuple[str, str, float]]:
        """(prompt, response, label) for the built-in reward model: answers right or off by one, verdicts right
        or wrong, final answers after a verdict."""
        examples = []
        for task in self.sample_tasks(rng, count):
            first = task["answer"] + int(rng.choice([0, 0, -1, 1]))
            verdict = str(rng.choice(["correct", "wrong"]))
            final = task["answer"] + int(rng.choice([0, -1, 1]))
            transcript = [Turn("solver", str(first)), Turn("verifier", verdict, f"Verdict: {verdict}")]
            examples += [
                (self.render_prompt("solver", task, []), str(first), float(first == task["answer"])),
                (self.render_prompt("verifier", task, transcript[:1]), verdict,
                 float((verdict == "correct") == (first == task["answer"]))),
                (self.render_prompt("solver", task, transcript), str(final), float(final == task["answer"])),
            ]
        return examples


def _first_line(text: str) -> str:
    return text.strip().split("\n", 1)[0].strip()


def _verdict_of(text: str) -> str | None:
    """``correct`` or ``wrong`` when the turn's first word is one of them (any case), else None."""
    words = _first_line(text).split(maxsplit=1)
    verdict = words[0].lower() if words else ""
    return verdict if verdict in ("correct", "wrong") else None


def _parse_int(text: str) -> int | None:
    token = _first_line(text).split(" ", 1)[0] if text.strip() else ""
    body = token[1:] if token.startswith("-") else token
    return int(token) if body.isdigit() and len(body) <= 9 else None
