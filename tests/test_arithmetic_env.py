"""The demo environment on hand-checked episodes."""

from __future__ import annotations

import numpy as np
import pytest

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


def test_the_verifier_is_shown_decoys_and_right_sums_on_their_shares_of_tasks() -> None:
    env = ArithmeticCheck(ArithmeticOptions(max_operand=3, decoy_share=0.3, right_share=0.2))
    tasks = env.sample_tasks(np.random.default_rng(3), 1000)
    decoys = [t for t in tasks if "shown" in t and t["shown"] != t["a"] + t["b"]]
    rights = [t for t in tasks if "shown" in t and t["shown"] == t["a"] + t["b"]]
    assert 0.25 < len(decoys) / len(tasks) < 0.35 and 0.15 < len(rights) / len(tasks) < 0.25
    assert all(0 <= t["shown"] <= 6 for t in decoys)
    # the sums are those of a run without substitutions: the shown answers are drawn after the operands
    plain = ArithmeticCheck(ArithmeticOptions(max_operand=3, decoy_share=0.0, right_share=0.0))
    plain = plain.sample_tasks(np.random.default_rng(3), 1000)
    assert [(t["a"], t["b"]) for t in tasks] == [(t["a"], t["b"]) for t in plain]
    assert not any("shown" in t for t in plain)
    with pytest.raises(ValueError, match=r"decoy_share \+ right_share = 1.2 > 1"):
        ArithmeticOptions(decoy_share=0.6, right_share=0.6)


def test_the_verifier_judges_what_it_is_shown_and_the_solver_is_still_scored_on_its_own_answer() -> None:
    env = _env()
    decoy, right = {"id": "2+3~6", "a": 2, "b": 3, "shown": 6}, {"id": "2+3~5", "a": 2, "b": 3, "shown": 5}
    assert env.render_prompt("verifier", decoy, [Turn("solver", "5")]) == "2+3=6?"
    cases = [(decoy, ("5", "no"), {"solver": 1.0, "verifier": 1.0}),   # the shown 6 is wrong: "no" is right
             (decoy, ("5", "yes"), {"solver": 1.0, "verifier": 0.0}),
             (decoy, ("4", "no"), {"solver": 0.0, "verifier": 1.0}),
             (right, ("4", "yes"), {"solver": 0.0, "verifier": 1.0})]  # the shown 5 is right, whatever the solver said
    for task, (answer, verdict), rewards in cases:
        transcript = [Turn("solver", answer), Turn("verifier", verdict)]
        results = env.execute(task, transcript)
        assert env.score(task, transcript, results) == rewards
        assert results[1].info["shown"] == str(task["shown"]) and results[1].info["substituted"] is True


def test_class_weights_pay_each_right_verdict_by_its_class_and_a_constant_verdict_the_same() -> None:
    env = ArithmeticCheck(ArithmeticOptions(max_operand=3, decoy_share=0.7, right_share=0.1, no_weight=0.4))
    decoy, right = {"id": "2+3~6", "a": 2, "b": 3, "shown": 6}, {"id": "2+3~5", "a": 2, "b": 3, "shown": 5}
    for task, verdict, reward in ((decoy, "no", 0.4), (decoy, "yes", 0.0), (right, "yes", 1.0), (right, "no", 0.0),
                                  (right, "maybe", 0.0)):
        transcript = [Turn("solver", "5"), Turn("verifier", verdict)]
        assert env.score(task, transcript, env.execute(task, transcript))["verifier"] == reward, (task, verdict)
    # a right verdict's class ("no" where the decoy shows 6) is in the result, for what a run stores
    assert env.execute(decoy, [Turn("solver", "5"), Turn("verifier", "yes")])[1].info["truth"] == "no"
    # With a right solver, "no" is right on the decoys' 70% of prompts: weights of about the inverse shares leave a
    # verifier nothing to gain from giving one verdict to every prompt.
    tasks = env.sample_tasks(np.random.default_rng(0), 2000)

    def earns(verdict: str) -> float:
        transcripts = [[Turn("solver", str(task["a"] + task["b"])), Turn("verifier", verdict)] for task in tasks]
        return float(np.mean([env.score(task, transcript, env.execute(task, transcript))["verifier"]
                              for task, transcript in zip(tasks, transcripts)]))

    earned = {verdict: earns(verdict) for verdict in ("yes", "no")}
    assert abs(earned["yes"] - earned["no"]) < 0.05 and min(earned.values()) > 0.2, earned
    for bad in ({"no_weight": 0.0}, {"yes_weight": 1.5}):
        with pytest.raises(ValueError, match=f"{next(iter(bad))}"):
            ArithmeticOptions(**bad)


def test_warm_up_verdicts_are_balanced_whatever_the_teacher_solver_says() -> None:
    env = ArithmeticCheck(ArithmeticOptions(max_operand=3, warmup_accuracy=1.0))
    examples = env.warmup_examples("verifier", np.random.default_rng(0), 1500)
    noes = sum(verdict == "no" for _, verdict in examples) / len(examples)
    assert 0.28 < noes < 0.38  # a perfect teacher: "no" exactly on the decoys, a third


def test_held_out_and_reward_model_examples_show_the_answer_their_label_is_about() -> None:
    env = ArithmeticCheck(ArithmeticOptions(max_operand=3))  # a third decoys, a third right sums
    for case in env.evaluation_cases("verifier", np.random.default_rng(2), 200):
        shown = case.transcript[0].text
        assert env.render_prompt("verifier", case.task, case.transcript).endswith(f"={shown}?")
        assert case.label == ("yes" if int(shown) == case.task["a"] + case.task["b"] else "no")
    for prompt, response, label in env.reward_examples(np.random.default_rng(2), 200):
        if prompt.endswith("?"):  # a verifier example: right when the verdict matches the shown sum
            a, rest = prompt[:-1].split("+")
            b, shown = rest.split("=")
            assert label == float((response == "yes") == (int(a) + int(b) == int(shown)))


def test_the_warm_up_teacher_knows_a_fixed_share_of_questions_and_guesses_on_the_rest() -> None:
    env = ArithmeticCheck(ArithmeticOptions(max_operand=3, warmup_accuracy=1.0, warmup_known_share=0.5))
    answers: dict[str, list[int]] = {}
    for prompt, answer in env.warmup_examples("solver", np.random.default_rng(0), 4000):
        answers.setdefault(prompt, []).append(int(answer))
    known = {prompt for prompt, given in answers.items() if len(set(given)) == 1}
    assert len(answers) == 16 and 4 <= len(known) <= 12  # half the 16 questions, by a hash
    for prompt in known:
        a, b = prompt[:-1].split("+")
        assert answers[prompt][0] == int(a) + int(b)
    for prompt in set(answers) - known:  # a uniform guess over 0..6: the right sum about 1 time in 7
        a, b = prompt[:-1].split("+")
        right = np.mean([answer == int(a) + int(b) for answer in answers[prompt]])
        assert right < 0.35 and len(set(answers[prompt])) == 7
    # The same questions, whatever the seed: version 0 is unsure on the same half in every run.
    again = env.warmup_examples("solver", np.random.default_rng(1), 4000)
    assert {prompt for prompt, answer in again if not _sums_to(prompt, answer)} <= set(answers) - known
    verdicts: dict[str, set[str]] = {}
    for prompt, verdict in env.warmup_examples("verifier", np.random.default_rng(0), 4000):
        verdicts.setdefault(prompt, set()).add(verdict)
    unsure = sum(len(given) == 2 for given in verdicts.values()) / len(verdicts)
    assert 0.3 < unsure < 0.7  # the verifier's teacher knows about half the (question, shown answer) pairs


def _sums_to(prompt: str, answer: str) -> bool:
    a, b = prompt[:-1].split("+")
    return int(a) + int(b) == int(answer)


def test_the_solver_alone_is_the_demo_without_its_verifier() -> None:
    """``arithmetic_solo`` (configs/demo_solver_alone.yaml's baseline): the demo's tasks, solver prompt, result,
    reward and held-out cases; and no team to measure."""
    import numpy as np

    from environments.arithmetic import ArithmeticCheck, ArithmeticOptions, ArithmeticSolo
    from marl_pipeline.environment import Turn
    from marl_pipeline.hooks import hooks_of

    options = ArithmeticOptions(max_operand=3)
    duo, solo = ArithmeticCheck(options), ArithmeticSolo(options)
    tasks = solo.sample_tasks(np.random.default_rng(0), 32)
    assert tasks == duo.sample_tasks(np.random.default_rng(0), 32)
    for task, answer in zip(tasks, ["3", "x", "6", "4"] * 8):
        assert solo.render_prompt("solver", task, []) == duo.render_prompt("solver", task, [])
        solver = Turn("solver", answer)
        [alone] = solo.execute(task, [solver])
        both = duo.execute(task, [solver, Turn("verifier", "yes")])
        assert alone == both[0]
        assert solo.score(task, [solver], [alone]) == {"solver": duo.score(task, [solver], both)["solver"]}
    assert solo.turn_order == ("solver",) and hooks_of(solo).team_choice is None
    assert hooks_of(duo).team_choice is not None
