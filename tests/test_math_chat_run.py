"""math_chat through a real training launch: built-in tiny models (plain-text prompts), real vLLM engines, real
Ray, grading on the action pool's worker processes (threads there, where math-verify's own timeouts would fail)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from environments.math_answers import check_math, same_answer, stated_answer
from marl_pipeline.config import parse_config
from marl_pipeline.run.events import EvaluationCommitted
from marl_pipeline.run.recipe import train
from marl_pipeline.store import ExperienceStore

pytestmark = pytest.mark.launch
SHARES_WARM_ACTORS = True  # its launches take the engines and trainers the module before kept (conftest)


def test_math_chat_worked_trains_with_the_tiny_model(local_ray, tmp_path: Path) -> None:
    """math_chat_worked: three turns (solver, the verifier's working, its verdict), and a verifier evaluated over two
    turns of its own."""
    data = {
        "run": "math_chat_tiny", "store": str(tmp_path / "store"),
        "environment": {"name": "math_chat_worked",
                        "options": {"prompt_format": "text", "a_range": [0, 4], "b_range": [0, 4],
                                    "warmup_accuracy": 0.8},
                        "pool": {"min_workers": 1, "max_workers": 1, "num_cpus": 0}},
        "agents": {role: {"warmup": {"steps": 30}} for role in ("solver", "verifier")},
        "pipeline": {"steps": 1, "prompts_per_micro_batch": 4, "samples_per_prompt": 4, "micro_batches_per_step": 2},
        "evaluation": {"every": 1, "cases_per_agent": 8},
        "ray": {"keep_actors": True},
    }
    config = parse_config(data)
    evaluated = {event.version: event.metrics for event in train(config) if isinstance(event, EvaluationCommitted)}
    store = ExperienceStore(config.store)
    rollouts = store.read_stage(config.run, "rollouts").to_pylist()
    results = store.read_stage(config.run, "environment_results").to_pylist()
    rewards = store.read_stage(config.run, "rewards").to_pylist()
    assert len(results) == len(rollouts) == 3 * 4 * 4 * 2 and {r["status"] for r in results} == {"ok"}
    said = {(r["group_id"], r["trajectory"], r["turn"]): r for r in rollouts}
    tasks = {r["sample_id"]: json.loads(r["task"]) for r in rollouts}
    shown_own = {}
    for result in results:
        info, task = json.loads(result["info"]), tasks[result["sample_id"]]
        episode = (result["group_id"], result["trajectory"])
        if result["turn"] < 2:
            # the solver's answer and the verifier's working, each graded against the task by math-verify on a
            # worker (grading in a thread), agreeing with math-verify in this process's main thread
            assert info["expected"] == task["answer"]
            assert result["outcome"] == ("correct" if check_math(task["answer"], said[(*episode, result["turn"])]
                                                                 ["response_text"]) else "wrong")
            continue
        # the verdict turn saw its own working, then the shown answer: its own one when the episode shows it and
        # the working is not empty, else one that differs from it
        verdict_prompt = said[(*episode, 2)]["prompt_text"]
        working = said[(*episode, 1)]["response_text"]
        assert verdict_prompt.startswith(said[(*episode, 1)]["prompt_text"] + working.strip())
        assert f"Another answer: {info['shown']}\n" in verdict_prompt
        own = stated_answer(working)
        if task["shows_own"] and own is not None:
            assert info["shown"] == own and info["working_matches"]
        else:
            assert not info["working_matches"] and not same_answer(working, info["shown"])
        assert info["agrees_with_working"] == (info["verdict"] == ("yes" if info["working_matches"] else "no"))
        shown_own.setdefault(result["group_id"], []).append(task["shows_own"])
    # each group of 4 episodes was meant to show the verifier its own answer twice, another answer twice
    assert len(shown_own) == 8 and all(sorted(kinds) == [False, False, True, True] for kinds in shown_own.values())
    # turn credit: the working earned its grade, the verdict its agreement with the working
    by_turn = {(r["group_id"], r["trajectory"], r["turn"]): r for r in results}
    verifier_rewards = [r for r in rewards if r["role"] == "verifier"]
    assert len(verifier_rewards) == 2 * 4 * 4 * 2
    for reward in verifier_rewards:
        result = by_turn[(reward["group_id"], reward["trajectory"], reward["turn"])]
        earned = (result["outcome"] == "correct" if reward["turn"] == 1
                  else json.loads(result["info"])["agrees_with_working"])
        assert reward["reward"] == float(earned)
    # small sums: the warmed-up tiny solver gets some right, so the agreement above is not all "wrong"
    assert any(r["outcome"] == "correct" for r in results if r["turn"] == 0)
    assert sorted(evaluated) == [0, 1]
    assert {"accuracy", "answer_entropy"} <= set(evaluated[0]["solver"])
    assert {"balanced_accuracy", "working_accuracy", "agreement"} <= set(evaluated[1]["verifier"])
    # held-out: the verifier worked each case out before its verdict, and the stored transcript shows it
    evaluations = [r for r in store.read_stage(config.run, "evaluations").to_pylist() if r["agent"] == "verifier"]
    assert evaluations and all([t["role"] for t in json.loads(r["transcript"])] == ["solver", "verifier"]
                               for r in evaluations)
