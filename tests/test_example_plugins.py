"""The plugins written from docs/environments.md alone (examples/): their episodes scored as their rules say, and
their configs accepted by the engine's checks, as the planner benchmark launches them (BENCHMARKS.md, planner on
plugins)."""

from __future__ import annotations

import numpy as np

from examples.gym_team.gym_team import GymTeam
from examples.tool_team.tool_team import ToolTeam, calculator
from marl_pipeline.config import parse_config
from marl_pipeline.environment import Turn, register_environment


def test_the_tool_teams_call_runs_the_calculator_and_the_answer_pays_both() -> None:
    team = ToolTeam(ToolTeam.Options(max_operand=5))
    task = {"id": "2+3+4", "a": 2, "b": 3, "c": 4}
    assert team.render_prompt("caller", task, []) == "2+3+4 call:"
    assert calculator(" 2 + 3 ") == "5" and calculator("2*3") == "error"
    called = [Turn("caller", "2+3", observation=team.observe("caller", task, [Turn("caller", "2+3")]))]
    assert team.render_prompt("answerer", task, called) == "tool 5 plus 4:"
    for answer, rewards in (("9", {"caller": 1.0, "answerer": 1.0}), ("8", {"caller": 0.0, "answerer": 0.0})):
        transcript = [*called, Turn("answerer", answer)]
        assert team.score(task, transcript, team.execute(task, transcript)) == rewards
    bad = [Turn("caller", "two", observation="error"), Turn("answerer", "9")]
    assert [r.outcome for r in team.execute(task, bad)] == ["bad_call", "right"]
    assert all(0 <= t["a"] <= 5 for t in team.sample_tasks(np.random.default_rng(0), 50))


def test_the_gym_teams_solver_is_graded_by_the_dataset_and_the_checker_by_agreeing() -> None:
    team = GymTeam(GymTeam.Options(size=20))
    task = team.sample_tasks(np.random.default_rng(0), 1)[0]
    entry = team.dataset[task["index"]]
    assert team.render_prompt("solver", task, []) == entry["question"].split(":")[-1].strip()
    wrong = str(int(entry["answer"]) + 1)
    for answer, verdict, rewards in ((entry["answer"], "yes", {"solver": 1.0, "checker": 1.0}),
                                     (wrong, "yes", {"solver": 0.0, "checker": 0.0}),
                                     (wrong, "no", {"solver": 0.0, "checker": 1.0})):
        transcript = [Turn("solver", answer), Turn("checker", verdict)]
        assert team.score(task, transcript, team.execute(task, transcript)) == rewards
    labels = {label for _, label in team.warmup_examples("checker", np.random.default_rng(1), 10)}
    assert labels == {"yes", "no"}


def test_both_plugins_make_configs_the_engine_accepts() -> None:
    for plugin in (ToolTeam, GymTeam):
        register_environment(plugin)
        config = parse_config({"run": "r", "environment": {"name": plugin.name},
                               "agents": {role: {"warmup": {"steps": 10}} for role in plugin.turn_order}})
        assert list(config.agents) == list(plugin.turn_order)
