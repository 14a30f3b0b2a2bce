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
    assert all(0 <= t["a"] <= 3 and 0 <= t["b"] <= 3 and t["id"].split("~")[0] == f"{t['a']}+{t['b']}"
               for t in first)


def test_decoys_are_wrong_answers_shown_to_the_verifier_on_their_share_of_tasks() -> None:
    env = ArithmeticCheck(ArithmeticOptions(max_operand=3, decoy_share=0.5))
    tasks = env.sample_tasks(np.random.default_rng(3), 400)
    decoyed = [t for t in tasks if "decoy" in t]
    assert 0.4 < len(decoyed) / len(tasks) < 0.6
    assert all(t["decoy"] != t["a"] + t["b"] and 0 <= t["decoy"] <= 6 for t in decoyed)
    # the sums are those of a run without decoys: the decoys are drawn after the operands
    plain = ArithmeticCheck(ArithmeticOptions(max_operand=3, decoy_share=0.0))
    plain = plain.sample_tasks(np.random.default_rng(3), 400)
    assert [(t["a"], t["b"]) for t in tasks] == [(t["a"], t["b"]) for t in plain]
    assert not any("decoy" in t for t in plain)


def test_the_verifier_judges_the_decoy_and_the_solver_is_still_scored_on_its_own_answer() -> None:
    env = _env()
    task = {"id": "2+3~6", "a": 2, "b": 3, "decoy": 6}
    assert env.render_prompt("verifier", task, [Turn("solver", "5")]) == "2+3=6?"
    cases = [(("5", "no"), {"solver": 1.0, "verifier": 1.0}),   # the shown 6 is wrong: "no" is right
             (("5", "yes"), {"solver": 1.0, "verifier": 0.0}),
             (("4", "no"), {"solver": 0.0, "verifier": 1.0})]
    for (answer, verdict), rewards in cases:
        transcript = [Turn("solver", answer), Turn("verifier", verdict)]
        results = env.execute(task, transcript)
        assert env.score(task, transcript, results) == rewards
        assert results[1].info["shown"] == "6" and results[1].info["decoy"] is True


def test_warm_up_verdicts_see_wrong_answers_about_half_the_time() -> None:
    env = ArithmeticCheck(ArithmeticOptions(max_operand=3, warmup_accuracy=1.0, decoy_share=0.5))
    examples = env.warmup_examples("verifier", np.random.default_rng(0), 1000)
    noes = sum(verdict == "no" for _, verdict in examples) / len(examples)
    assert 0.4 < noes < 0.6  # a perfect teacher: "no" exactly on the decoys, about half
