"""The team benchmark's task on hand-checked episodes: (a+b)*c split between an adder and a multiplier, the team's
answer the multiplier's (``answering_role``), and one agent doing it whole."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from environments.arithmetic_chain import ArithmeticChain, ArithmeticChainSolo, ChainOptions
from marl_pipeline.config import ConfigError, parse_config
from marl_pipeline.environment import Turn, available_environments, register_environment
from marl_pipeline.hooks import hooks_of
from marl_pipeline.stages.evaluation import team_metrics

ROOT = Path(__file__).resolve().parents[1]
TASK = {"id": "(2+1)*3", "a": 2, "b": 1, "c": 3}


def test_each_role_does_its_own_step_and_is_rewarded_for_it() -> None:
    env = ArithmeticChain(ChainOptions())
    assert available_environments()["arithmetic_chain"] is ArithmeticChain
    assert env.render_prompt("adder", TASK, []) == "2+1="
    assert env.render_prompt("multiplier", TASK, [Turn("adder", "4\nmore")]) == "4*3="  # its sum, not the task's
    cases = [(("3", "9"), ("correct", "correct"), {"adder": 1.0, "multiplier": 1.0}),
             (("4", "12"), ("wrong", "correct"), {"adder": 0.0, "multiplier": 1.0}),  # right on what it was shown
             (("4", "9"), ("wrong", "wrong"), {"adder": 0.0, "multiplier": 0.0}),
             (("x", "9"), ("unparsable", "correct"), {"adder": 0.0, "multiplier": 1.0}),  # nothing shown: the task's
             (("3", "nine"), ("correct", "unparsable"), {"adder": 1.0, "multiplier": 0.0})]
    for (added, product), outcomes, rewards in cases:
        transcript = [Turn("adder", added), Turn("multiplier", product)]
        results = env.execute(TASK, transcript)
        assert tuple(result.outcome for result in results) == outcomes, (added, product)
        assert env.score(TASK, transcript, results) == rewards, (added, product)


def test_the_team_answers_with_the_multipliers_majority_on_its_held_out_cases() -> None:
    env = ArithmeticChain(ChainOptions())
    assert hooks_of(env).answering_role == "multiplier"
    [case] = env.evaluation_cases("multiplier", np.random.default_rng(0), 1)
    total = case.task["a"] + case.task["b"]
    assert case.transcript == [Turn("adder", str(total))] and case.label == str(total * case.task["c"])

    def row(task: dict, episodes: list[tuple[str, str]]) -> dict:
        played = [[{"role": "adder", "text": s, "observation": None},
                   {"role": "multiplier", "text": p, "observation": None}] for s, p in episodes]
        label = str((task["a"] + task["b"]) * task["c"])
        return {"task": json.dumps(task), "label": label, "transcript": json.dumps(played), "answer": "-"}

    rows = [row(TASK, [("4", "12"), ("3", "9"), ("3", "9")]),  # the majority is right, the first sample is not
            row({"id": "(1+1)*2", "a": 1, "b": 1, "c": 2}, [("2", "4"), ("3", "6"), ("3", "6")])]
    figures = team_metrics(env, rows)
    assert (figures["team_answer"], figures["first_sample"], figures["majority_vote"], figures["any_sample"]) == (
        0.5, 0.5, 0.5, 1.0)


def test_one_agent_answers_the_whole_task_on_the_same_cases() -> None:
    options = ChainOptions()
    team, solo = ArithmeticChain(options), ArithmeticChainSolo(options)
    assert solo.render_prompt("solver", TASK, []) == "(2+1)*3="
    assert [r.outcome for r in solo.execute(TASK, [Turn("solver", "9")])] == ["correct"]
    assert solo.score(TASK, [Turn("solver", "8")], solo.execute(TASK, [Turn("solver", "8")])) == {"solver": 0.0}
    team_cases = team.evaluation_cases("multiplier", np.random.default_rng(5), 50)
    solo_cases = solo.evaluation_cases("solver", np.random.default_rng(5), 50)
    assert [(c.task, c.label) for c in team_cases] == [(c.task, c.label) for c in solo_cases]
    assert hooks_of(solo).answering_role == "solver" and hooks_of(solo).team_choice is not None
    # Its warm-up teacher knows half its table, as each of the team's teachers knows half of theirs.
    examples = solo.warmup_examples("solver", np.random.default_rng(1), 2000)
    right = np.mean([int(answer) == eval(prompt[:-1]) for prompt, answer in examples])
    assert 0.4 < right < 0.7, right
    for role in team.turn_order:
        examples = team.warmup_examples(role, np.random.default_rng(1), 2000)
        right = np.mean([int(answer) == eval(prompt[:-1]) for prompt, answer in examples])
        assert 0.4 < right < 0.7, (role, right)


def test_an_answering_role_the_environment_lacks_is_refused(tmp_path: Path) -> None:
    data = yaml.safe_load((ROOT / "configs" / "chain.yaml").read_text())
    data["store"] = str(tmp_path)
    assert list(parse_config(data).agents) == ["adder", "multiplier"]

    class Misnamed(ArithmeticChain):
        name = "misnamed_chain"
        answering_role = "checker"

    register_environment(Misnamed)
    with pytest.raises(ConfigError, match=r"gives the team's answer to role 'checker' \(answering_role\), which it "
                                          r"does not have; roles \['adder', 'multiplier'\]"):
        parse_config({**data, "environment": {**data["environment"], "name": "misnamed_chain"}})


def test_held_out_questions_are_never_trained_on_and_their_steps_are() -> None:
    options = ChainOptions(max_operand=5, max_factor=4, heldout_share=0.25)
    team, solo = ArithmeticChain(options), ArithmeticChainSolo(options)
    trained = {task["id"] for task in team.sample_tasks(np.random.default_rng(0), 4000)}
    warmed = {prompt[:-1] for prompt, _ in solo.warmup_examples("solver", np.random.default_rng(1), 4000)}
    asked = {case.task["id"] for case in solo.evaluation_cases("solver", np.random.default_rng(2), 400)}
    assert asked and not asked & (trained | warmed), asked & (trained | warmed)
    assert len(trained) + len(asked) == 6 * 6 * 4  # every question is one or the other
    assert {case.task["id"] for case in team.evaluation_cases("multiplier", np.random.default_rng(2), 400)} == asked
    sums = {(task.split(")")[0][1:]) for task in trained}
    assert all(task.split(")")[0][1:] in sums for task in asked)  # every held-out question's sum is trained
    # at 0, the held-out cases are fresh draws of training's questions
    fresh = ArithmeticChain(ChainOptions(max_operand=5, max_factor=4))
    assert {c.task["id"] for c in fresh.evaluation_cases("adder", np.random.default_rng(2), 400)} <= {
        task["id"] for task in fresh.sample_tasks(np.random.default_rng(0), 4000)}


def test_a_split_with_nothing_on_one_side_is_refused() -> None:
    with pytest.raises(ValueError, match=r"heldout_share 0.001 holds out 0 of the 8 questions"):
        ChainOptions(max_operand=1, max_factor=2, heldout_share=0.001)
    with pytest.raises(ValueError, match=r"heldout_share 0.999 holds out 8 of the 8 questions"):
        ChainOptions(max_operand=1, max_factor=2, heldout_share=0.999)
