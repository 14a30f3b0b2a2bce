"""Code writer-tester: the writer writes a Python function, the tester writes tests for it.

The writer's code runs in the sandbox (marl_pipeline.sandbox) against hidden reference tests: its
reward is the pass rate. The tester's ``assert`` lines run against the hidden reference solution:
its reward is the share of its tests that hold there (0 with no test). Both actions run on the
environment stage's action pool, one sandboxed process per action.
"""

from __future__ import annotations

import json

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from marl_pipeline.config import PoolSettings
from marl_pipeline.environment import Action, ActionResult, Task, Turn
from marl_pipeline.sandbox import SandboxLimits, run_python

TASKS: tuple[Task, ...] = (
    {"id": "add", "spec": "def add(a, b): return the sum", "reference": "def add(a, b):\n    return a + b",
     "tests": ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(0, 0) == 0"]},
    {"id": "double", "spec": "def double(x): return 2*x", "reference": "def double(x):\n    return 2 * x",
     "tests": ["assert double(2) == 4", "assert double(0) == 0", "assert double(-3) == -6"]},
    {"id": "is_even", "spec": "def is_even(n): True if n is even",
     "reference": "def is_even(n):\n    return n % 2 == 0",
     "tests": ["assert is_even(2)", "assert not is_even(3)", "assert is_even(0)"]},
    {"id": "last", "spec": "def last(xs): the last item", "reference": "def last(xs):\n    return xs[-1]",
     "tests": ["assert last([1, 2]) == 2", "assert last('ab') == 'b'", "assert last([0]) == 0"]},
)

# Runs in the sandbox: defines the code under test, then runs each test on its own (a failing test never
# hides the others), and prints one JSON line with the counts.
_HARNESS = """
import json
namespace = {}
try:
    exec(compile(CODE, "solution", "exec"), namespace)
    defined = True
except BaseException as error:
    defined = False
passed = 0
for test in TESTS:
    if not defined:
        break
    try:
        exec(compile(test, "test", "exec"), dict(namespace))
        passed += 1
    except BaseException:
        pass
print(json.dumps({"passed": passed, "total": len(TESTS), "defined": defined}))
"""


class CodeOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    cpu_seconds: int = Field(2, ge=1)
    """CPU limit of one sandboxed run."""
    wall_seconds: float = Field(5.0, gt=0)
    """Wall-clock limit of one sandboxed run."""
    memory_mb: int = Field(256, ge=64)
    """Address-space limit of one sandboxed run."""
    max_tests: int = Field(10, ge=1)
    """Tester assert lines kept per episode."""
    team_reward_weight: float = Field(0.0, ge=0, le=1)
    """Credit assignment: 0 each agent's own reward, 1 the team's mean, in between a mix."""
    pool: PoolSettings = PoolSettings(min_workers=1, max_workers=2, timeout_s=30.0)
    """The action pool the sandboxed runs are scheduled on."""


class CodeWriterTester:
    """Writer + tester on small Python functions."""

    name = "code_writer_tester"
    turn_order = ("writer", "tester")
    Options = CodeOptions

    def __init__(self, options: CodeOptions) -> None:
        self.options = options
        self.team_reward_weight = options.team_reward_weight
        self.pool_settings = options.pool
        self.limits = SandboxLimits(cpu_seconds=options.cpu_seconds, wall_seconds=options.wall_seconds,
                                    memory_bytes=options.memory_mb * 2**20)

    def sample_tasks(self, rng: np.random.Generator, count: int) -> list[Task]:
        return [dict(TASKS[i]) for i in rng.integers(0, len(TASKS), size=count)]

    def render_prompt(self, role: str, task: Task, transcript: list[Turn]) -> str:
        if role == "writer":
            return f"# {task['spec']}\n"
        if role == "tester":
            return f"# tests for {task['spec']}\nassert "  # the tester sees the spec, never the writer's code
        raise ValueError(f"{self.name} has no role {role!r}")

    def actions(self, task: Task, transcript: list[Turn]) -> list[Action | None]:
        tests = [line.strip() for line in ("assert " + transcript[1].text).splitlines()
                 if line.strip().startswith("assert ")][: self.options.max_tests]
        return [Action("code", transcript[0].text, 2.0, {"tests": task["tests"]}),
                Action("tests", "\n".join(tests), 1.0, {"reference": task["reference"]})]

    def run_action(self, action: Action) -> ActionResult:
        if action.kind == "code":
            code, tests = action.payload, action.context["tests"]
        elif action.kind == "tests":
            code, tests = action.context["reference"], [t for t in action.payload.splitlines() if t]
            if not tests:
                return ActionResult("no_tests", False, info={"passed": 0, "total": 0})
        else:
            raise ValueError(f"{self.name}: unknown action kind {action.kind!r}")
        program = f"CODE = {code!r}\nTESTS = {tests!r}\n{_HARNESS}"
        result = run_python(program, self.limits)
        if result.status != "ok":
            return ActionResult(f"sandbox_{result.status}", False, info={"reason": result.reason})
        counts = json.loads(result.stdout.strip().splitlines()[-1])
        rate = counts["passed"] / counts["total"]
        outcome = "all_passed" if rate == 1 else "some_passed" if rate > 0 else "none_passed"
        return ActionResult(outcome, rate == 1, observation=result.stdout.strip(), info={**counts, "rate": rate})

    def execute(self, task: Task, transcript: list[Turn]) -> list[ActionResult]:
        return [self.run_action(a) for a in self.actions(task, transcript)]

    def score(self, task: Task, transcript: list[Turn], results: list[ActionResult]) -> dict[str, float]:
        return {"writer": float(results[0].info.get("rate", 0.0)), "tester": float(results[1].info.get("rate", 0.0))}

    def text_corpus(self, rng: np.random.Generator, count: int) -> list[str]:
        return [p + c for role in self.turn_order for p, c in self.warmup_examples(role, rng, count)]

    def warmup_examples(self, role: str, rng: np.random.Generator, count: int) -> list[tuple[str, str]]:
        tasks = self.sample_tasks(rng, count)
        if role == "writer":
            return [(self.render_prompt("writer", t, []), t["reference"]) for t in tasks]
        return [(self.render_prompt("tester", t, []), t["tests"][0].removeprefix("assert ")) for t in tasks]
