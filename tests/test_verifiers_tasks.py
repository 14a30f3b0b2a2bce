"""verifiers' tasksets as one role of a team (environments/verifiers_tasks.py), on the real verifiers package: a taskset
written in verifiers' own format (tests/verifiers_reverse/) loaded by verifiers' loader, its rewards scoring the
solver, a checker rewarded for saying whether the answer earned them, and a launch whose stored rewards are the ones
verifiers gives the stored replies."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from environments.verifiers_tasks import VerifiersTask, VerifiersTeam
from marl_pipeline.config import ConfigError, parse_config
from marl_pipeline.environment import Turn, register_environment
from marl_pipeline.run.recipe import train
from marl_pipeline.store import ExperienceStore

TASKSETS = Path(__file__).resolve().parent / "verifiers_reverse"


@pytest.fixture(autouse=True)
def _tasksets_installed(monkeypatch) -> None:
    """The test's taskset packages importable by their ids, as an installed taskset package is."""
    monkeypatch.syspath_prepend(str(TASKSETS))


def _team(**options) -> VerifiersTeam:
    return VerifiersTeam(VerifiersTeam.Options(taskset="reverse_words", **options))


def test_the_tasksets_rewards_score_the_solver_and_the_checker_is_paid_for_a_true_verdict() -> None:
    team = _team(taskset_config={"num_tasks": 12}, prompt_format="text")
    assert len(team.tasks) == 12 and type(team.tasks[0]).__name__ == "ReverseTask"  # verifiers' loader, its config
    task = {"id": "reverse_words-3", "index": 3}
    assert team.render_prompt("solver", task, []) == "reverse map:"
    assert team.reward_of(task, "pam") == 1.0 and team.reward_of(task, "map") == 0.0
    for reply, verdict, rewards in (("pam", "yes", {"solver": 1.0, "checker": 1.0}),
                                    ("pam", "No.", {"solver": 1.0, "checker": 0.0}),
                                    ("mpa", "no", {"solver": 0.0, "checker": 1.0}),
                                    ("mpa", "maybe", {"solver": 0.0, "checker": 0.0})):
        transcript = [Turn("solver", reply), Turn("checker", verdict)]
        assert "Answer: " + reply in team.render_prompt("checker", task, transcript[:1])
        results = team.execute(task, transcript)
        assert team.score(task, transcript, results) == rewards, (reply, verdict)
    assert results[1].outcome == "unreadable"
    chat = _team(taskset_config={"num_tasks": 12})
    assert chat.render_prompt("solver", task, []) == [{"role": "user", "content": "reverse map:"}]
    alone = VerifiersTask(VerifiersTask.Options(taskset="reverse_words"))
    assert alone.turn_order == ("solver",)
    assert alone.score(task, [Turn("solver", "pam")], alone.execute(task, [Turn("solver", "pam")])) == {"solver": 1.0}


def test_the_warm_up_shows_reference_answers_labelled_by_the_tasks_own_rewards() -> None:
    team = _team(answer_field="answer", prompt_format="text")
    rng = np.random.default_rng(0)
    index = {task.data.prompt: k for k, task in enumerate(team.tasks)}
    assert all(team.reward_of({"index": index[prompt]}, answer) == 1.0
               for prompt, answer in team.warmup_examples("solver", rng, 8))
    checked = team.warmup_examples("checker", rng, 40)
    assert {label for _, label in checked} == {"yes", "no"}
    for prompt, label in checked:
        question, answer = prompt.split("\n")[0], prompt.split("\n")[1].removeprefix("Answer: ")
        assert (question.split()[1].rstrip(":")[::-1] == answer) == (label == "yes")
    with pytest.raises(ValueError, match=r"needs environment\.options\.answer_field"):
        _team().warmup_examples("solver", rng, 2)


def test_a_taskset_that_cannot_be_a_turn_is_refused_when_the_config_loads() -> None:
    def config(**options) -> dict:
        return {"run": "r", "environment": {"name": "verifiers_team", "options": {"taskset": "reverse_words",
                                                                                   **options}},
                "agents": {"solver": {"warmup": {"steps": 0}}, "checker": {"warmup": {"steps": 0}}}}

    register_environment(VerifiersTeam)
    with pytest.raises(ConfigError, match=r"taskset 'no_such_taskset' cannot be loaded: taskset 'no_such_taskset' "
                                          r"not found"):
        parse_config(config(taskset="no_such_taskset"))
    with pytest.raises(ConfigError, match=r"none of its rewards \(\['file_written'\]\) can score a reply without a "
                                          r"runtime"):
        parse_config(config(taskset="needs_a_box"))
    with pytest.raises(ConfigError, match=r"(?s)cannot be loaded: .*num_taskz"):
        parse_config(config(taskset_config={"num_taskz": 3}))
    with pytest.raises(ConfigError, match=r"has no field 'solution' \(answer_field\)"):
        parse_config(config(answer_field="solution"))


@pytest.fixture
def ray_with_the_tasksets():
    """A Ray of its own whose workers import the test's taskset packages, as a cluster with the package installed:
    the warm-up and the tiny model's tokenizer load the tasks in Ray workers."""
    import ray

    from tests.conftest import ROOT

    if ray.is_initialized():
        ray.shutdown()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": f"{TASKSETS}:{ROOT}"}})
    yield ray
    ray.shutdown()


@pytest.mark.launch
def test_a_team_trains_on_a_verifiers_taskset_and_stores_the_rewards_verifiers_gives(ray_with_the_tasksets,
                                                                                    tmp_path) -> None:
    register_environment(VerifiersTeam)
    small = {"warmup": {"steps": 60, "batch_size": 8}, "engine": {"num_cpus": 0.25, "max_model_len": 256},
             "trainer": {"num_cpus": 0.25}, "algorithm": {"max_new_tokens": 4}}
    config = parse_config({
        "run": "verifiers", "store": str(tmp_path / "store"),
        "environment": {"name": "verifiers_team", "options": {"taskset": "reverse_words", "answer_field": "answer",
                                                              "prompt_format": "text"}},
        "agents": {"solver": small, "checker": small},
        "pipeline": {"steps": 1, "prompts_per_micro_batch": 4, "samples_per_prompt": 4, "micro_batches_per_step": 1}})
    list(train(config))
    store = ExperienceStore(config.store)
    turns = {row["sample_id"]: row for row in store.read_stage(
        config.run, "rollouts", columns=["sample_id", "role", "task", "response_text"]).to_pylist()}
    rewards = store.read_stage(config.run, "rewards", columns=["sample_id", "role", "reward"]).to_pylist()
    team = _team(answer_field="answer", prompt_format="text")
    solver = [row for row in rewards if row["role"] == "solver"]
    assert len(solver) == 4 * 4 and len(rewards) == 2 * 4 * 4
    for row in solver:  # each stored reward is what the taskset's own reward function gives the stored reply
        turn = turns[row["sample_id"]]
        assert row["reward"] == team.reward_of(json.loads(turn["task"]), turn["response_text"])
    assert store.policy_versions(config.run, "solver") == [0, 1] == store.policy_versions(config.run, "checker")
