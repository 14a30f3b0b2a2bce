"""math_chat through a real training launch: built-in tiny models (plain-text prompts), real vLLM engines, real
Ray, grading on the action pool's worker processes (threads there, where math-verify's own timeouts would fail)."""

from __future__ import annotations

import json
from pathlib import Path

from environments.math_answers import answer_text, check_math
from marl_pipeline.config import parse_config
from marl_pipeline.run.events import EvaluationCommitted
from marl_pipeline.run.recipe import train
from marl_pipeline.store import ExperienceStore


def test_math_chat_trains_with_the_tiny_model(local_ray, tmp_path: Path) -> None:
    data = {
        "run": "math_chat_tiny", "store": str(tmp_path / "store"),
        "environment": {"name": "math_chat", "options": {"prompt_format": "text", "a_range": [0, 4], "b_range": [0, 4],
                                                      "warmup_accuracy": 0.8,
                                                      "shown_answers": "balanced"},
                        "pool": {"min_workers": 1, "max_workers": 1, "num_cpus": 0}},
        "agents": {role: {"warmup": {"steps": 30}, "engine": {"num_cpus": 0.25}, "trainer": {"num_cpus": 0.25}}
                   for role in ("solver", "verifier")},
        "pipeline": {"steps": 1, "prompts_per_micro_batch": 4, "samples_per_prompt": 4, "micro_batches_per_step": 2},
        "evaluation": {"every": 1, "cases_per_agent": 8},
    }
    config = parse_config(data)
    evaluated = {event.version: event.metrics for event in train(config) if isinstance(event, EvaluationCommitted)}
    store = ExperienceStore(config.store)
    rollouts = store.read_stage(config.run, "rollouts").to_pylist()
    results = store.read_stage(config.run, "environment_results").to_pylist()
    assert len(results) == len(rollouts) == 2 * 4 * 4 * 2 and {r["status"] for r in results} == {"ok"}
    # every answer was graded against its task by math-verify on a worker: the expected sum is recorded
    tasks = {r["sample_id"]: json.loads(r["task"]) for r in rollouts}
    solver_said = {(r["group_id"], r["trajectory"]): r["response_text"] for r in rollouts if r["turn"] == 0}
    responses = {r["sample_id"]: r["response_text"] for r in rollouts}
    shown_right = {}
    for result in results:
        info, task = json.loads(result["info"]), tasks[result["sample_id"]]
        if result["turn"] == 0:
            assert info["expected"] == task["answer"]
            # the worker (grading in a thread) agrees with math-verify in this process's main thread
            assert result["outcome"] == ("correct" if check_math(task["answer"], responses[result["sample_id"]])
                                         else "wrong")
        else:
            # the verifier was judged on what it saw: the solver's answer when it is of the kind this episode
            # shows (right or wrong, as the environment's episode_task alternates it), else the right answer or the
            # episode's own wrong one
            solver = answer_text(solver_said[(result["group_id"], result["trajectory"])])
            solver_fits = bool(solver) and check_math(task["answer"], solver) == task["shows_right"]
            expected = solver if solver_fits else task["answer"] if task["shows_right"] else task["wrong_answer"]
            assert info["shown"] == expected and info["shown_right"] == task["shows_right"]
            shown_right.setdefault(result["group_id"], []).append(task["shows_right"])
    # each group of 4 episodes showed the verifier 2 right and 2 wrong answers
    assert len(shown_right) == 8 and all(sorted(kinds) == [False, False, True, True] for kinds in shown_right.values())
    # small sums: the warmed-up tiny solver gets some right, so the agreement above is not all "wrong"
    assert any(r["outcome"] == "correct" for r in results if r["turn"] == 0)
    assert sorted(evaluated) == [0, 1]
    assert {"accuracy", "answer_entropy"} <= set(evaluated[0]["solver"])
    assert {"balanced_accuracy", "readable_verdicts"} <= set(evaluated[1]["verifier"])
