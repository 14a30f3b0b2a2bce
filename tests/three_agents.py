"""Tests-only plugin: the demo's solver and verifier and a third agent, a reporter, who gives the team's sum after
them (``arithmetic_report``). Registered on import; a `marl train` process imports it before the CLI runs
(:data:`CLI`), and its Ray workers find it on ``PYTHONPATH``, as an installed plugin's would through its
package."""

from __future__ import annotations

import sys

from environments.arithmetic import ArithmeticCheck
from marl_pipeline.environment import ActionResult, Turn, register_environment

CLI = (sys.executable, "-c", "import sys, tests.three_agents; from assets.cli import app; sys.argv[0] = 'marl'; app()")
"""The `marl` command with this plugin registered: ``[*CLI, "train", config]``."""


class ArithmeticReport(ArithmeticCheck):
    """``arithmetic_check`` and a reporter, shown the question, the answer and the verdict (``2+3=5?yes:``), who
    answers the sum; rewarded for the right one."""

    name = "arithmetic_report"
    turn_order = ("solver", "verifier", "reporter")

    def render_prompt(self, role: str, task: dict, transcript: list[Turn]) -> str:
        if role != "reporter":
            return super().render_prompt(role, task, transcript)
        return f"{super().render_prompt('verifier', task, transcript)}{transcript[1].text.strip()[:3]}:"

    def execute(self, task: dict, transcript: list[Turn]) -> list[ActionResult]:
        reported = transcript[2].text.strip().split("\n", 1)[0]
        right = reported == str(task["a"] + task["b"])
        return [*super().execute(task, transcript), ActionResult("right" if right else "wrong", right)]

    def score(self, task: dict, transcript: list[Turn], results: list[ActionResult]) -> dict[str, float]:
        return {**super().score(task, transcript, results), "reporter": float(results[2].success)}

    def text_corpus(self, rng, count: int) -> list[str]:
        return [prompt + completion for role in self.turn_order
                for prompt, completion in self.warmup_examples(role, rng, count)]

    def warmup_examples(self, role: str, rng, count: int) -> list[tuple[str, str]]:
        if role != "reporter":
            return super().warmup_examples(role, rng, count)
        examples = []
        for task in self.sample_tasks(rng, count):
            transcript = [Turn("solver", str(task["a"] + task["b"])), Turn("verifier", "yes")]
            examples.append((self.render_prompt("reporter", task, transcript), str(task["a"] + task["b"])))
        return examples


register_environment(ArithmeticReport)
