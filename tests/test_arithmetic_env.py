"""The demo environment on hand-checked episodes."""

from __future__ import annotations

import numpy as np

from environments.arithmetic import ArithmeticCheck, ArithmeticOptions
from marl_pipeline.environment import Turn, available_environments, build_environment


def _env() -> ArithmeticCheck:
    return ArithmeticCheck(ArithmeticOptions(max_operand=3))


def test_registered_through_entry_points() -> None:
    assert available_environments()["arithmetic_check"] is ArithmeticCheck
    assert isinstance(build_environment("arithmetic_check", {"max_operand": 2}), ArithmeticCheck)


def test_verifier_sees_the_solvers_turn() -> None:
    env = _env()
    task = {"id": "2+3", "a": 2, "b": 3}
    assert env.render_prompt("solver", task, []) == "2+3="
    assert env.render_prompt("verifier", task, [Turn("solver", "5")]) == "2+3=5?"


def test_outcomes_and_rewards_by_hand() -> None:
    env = _env()
    task = {"id": "2+3", "a": 2, "b": 3}
    cases = [
        (("5", "yes"), ("correct", "right_verdict"), {"solver": 1.0, "verifier": 1.0}),
        (("5", "no"), ("correct", "wrong_verdict"), {"solver": 1.0, "verifier": 0.0}),
        (("4", "no"), ("wrong", "right_verdict"), {"solver": 0.0, "verifier": 1.0}),
        (("4", "yes"), ("wrong", "wrong_verdict"), {"solver": 0.0, "verifier": 0.0}),
        (("five", "maybe"), ("unparsable", "unparsable"), {"solver": 0.0, "verifier": 0.0}),
        (("five", "no"), ("unparsable", "right_verdict"), {"solver": 0.0, "verifier": 1.0}),
    ]
    for (answer, verdict), outcomes, rewards in cases:
        transcript = [Turn("solver", answer), Turn("verifier", verdict)]
        results = env.execute(task, transcript)
        assert tuple(r.outcome for r in results) == outcomes
        assert env.score(task, transcript, results) == rewards


def test_tasks_are_reproducible_and_in_range() -> None:
    env = _env()
    first = env.sample_tasks(np.random.default_rng(7), 50)
    assert first == env.sample_tasks(np.random.default_rng(7), 50)
    assert all(0 <= t["a"] <= 3 and 0 <= t["b"] <= 3 and t["id"] == f"{t['a']}+{t['b']}" for t in first)
