"""The demo's solver and verifier with a tool outside the cluster: after the solver's turn, the environment asks a
calculator service for the sum (``marl_pipeline.environment.service``, so the run's quota for it holds however
many episodes, stages and workers ask at once) and shows its reply to the verifier, who learns to compare.

The service is any HTTP endpoint answering ``POST /sum {"a": 2, "b": 3}`` with ``{"sum": 5}``, declared in the
experiment as ``services.calculator`` (docs/environments.md, "Calling services outside the cluster"). Where no reply
was recorded (warm-up examples, held-out cases: no run's services are up then), the verifier's prompt shows the
sum the calculator answers, computed here.
"""

from __future__ import annotations

from pydantic import Field

from environments.arithmetic import ArithmeticCheck, ArithmeticOptions
from marl_pipeline.environment import Task, Turn, service


class ArithmeticToolOptions(ArithmeticOptions):
    service: str = "calculator"
    """The run's service (``services.<name>``) the environment asks for sums."""
    expected_cost: float = Field(1.0, gt=0)
    """The call's relative cost for the service's scheduler (cheaper calls are granted first)."""


class ArithmeticWithTool(ArithmeticCheck):
    """Solver + verifier on ``a+b``; the verifier sees the calculator's sum after the answer it judges."""

    name = "arithmetic_tool"
    Options = ArithmeticToolOptions

    def observe(self, role: str, task: Task, transcript: list[Turn]) -> str | None:
        if role != "solver":
            return None
        reply = service(self.options.service).post("/sum", {"a": task["a"], "b": task["b"]},
                                                   expected_cost=self.options.expected_cost)
        return str(int(reply["sum"]))

    def render_prompt(self, role: str, task: Task, transcript: list[Turn]) -> str:
        prompt = super().render_prompt(role, task, transcript)
        if role != "verifier":
            return prompt
        tool = transcript[0].observation if transcript[0].observation is not None else str(task["a"] + task["b"])
        return f"{prompt}{tool}:"
