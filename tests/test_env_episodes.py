"""Real episodes of the shipped environments through a real vLLM engine on CPU, the real pool and sandbox.

The built-in tiny model was trained on the demo's text, so its samples here are mostly garbage: the
hand-checked outcomes are in test_credit_and_actions.py and below (hand-written code); these tests check
that real episodes are recorded with one outcome per turn from the environment's own labels.
"""

from __future__ import annotations

import itertools
import json
from collections import defaultdict

import pytest

from environments.code_tester import CodeOptions, CodeWriterTester
from environments.math_verifier import MathOptions, MathSolverVerifier
from marl_pipeline.actions.pool import ActionPool
from marl_pipeline.config import GRPOAdvantage, PoolSettings, RolloutConfig
from marl_pipeline.environment import ActionResult, Turn
from marl_pipeline.inference.async_engine import AsyncRolloutEngine
from marl_pipeline.inference.engine import ENGINE_ENV
from marl_pipeline.stages.execution import execute_micro_batch
from marl_pipeline.stages.reward import score_micro_batch
from marl_pipeline.stages.rollout import RolloutSettings
from marl_pipeline.stages.trajectories import rollout_trajectories
from marl_pipeline.store import MicroBatchKey


@pytest.fixture(scope="module")
def engine(local_ray, tiny_model_dir):
    actor = local_ray.remote(AsyncRolloutEngine).options(num_cpus=0.5, runtime_env={"env_vars": ENGINE_ENV})
    handle = actor.remote(str(tiny_model_dir), 0, gpu_memory_utilization=0.08, max_model_len=256, dtype="float32",
                          seed=0)
    yield handle
    local_ray.kill(handle)


SETTINGS = RolloutSettings(seed=0, prompts_per_micro_batch=2, samples_per_prompt=2,  # every role of every env alike
                           max_new_tokens=defaultdict(lambda: 8), temperature=defaultdict(lambda: 1.0))


def _episode(env, engine, pool):
    rollouts = rollout_trajectories(env, {role: engine for role in env.turn_order}, MicroBatchKey("t", 0, 0), SETTINGS,
                                    RolloutConfig())
    results = execute_micro_batch(env, rollouts, pool=pool)
    rewards = score_micro_batch(env, rollouts, results, advantage=GRPOAdvantage(eps=1e-6))
    return rollouts, results, rewards


@pytest.mark.launch
def test_math_solver_verifier_real_episodes(engine) -> None:
    env = MathSolverVerifier(MathOptions(max_operand=3))
    pool = ActionPool(PoolSettings(min_workers=1, max_workers=2, num_cpus=0))
    rollouts, results, rewards = _episode(env, engine, pool)
    assert rollouts.num_rows == 2 * 2 * 3 and results.num_rows == rewards.num_rows == rollouts.num_rows
    labels = {"correct", "wrong", "unparsable", "right_verdict", "wrong_verdict"}
    assert set(results.column("outcome").to_pylist()) <= labels
    assert set(results.column("status").to_pylist()) == {"ok"}
    assert all(r in (0.0, 1.0) for r in rewards.column("reward").to_pylist())
    pool.shutdown()


def test_code_writer_tester_real_episodes(engine) -> None:
    env = CodeWriterTester(CodeOptions())
    pool = ActionPool(PoolSettings(min_workers=1, max_workers=2, num_cpus=0))
    rollouts, results, rewards = _episode(env, engine, pool)
    assert results.num_rows == rollouts.num_rows == 2 * 2 * 2
    labels = {"all_passed", "some_passed", "none_passed", "no_tests", "sandbox_error", "sandbox_denied",
              "sandbox_timeout", "sandbox_cpu_limit", "sandbox_memory_limit"}
    assert set(results.column("outcome").to_pylist()) <= labels
    assert all(0.0 <= r <= 1.0 for r in rewards.column("reward").to_pylist())
    pool.shutdown()


@pytest.mark.launch
def test_code_writer_tester_by_hand() -> None:
    # A wall limit far above the CPU limit: on a loaded machine a busy loop gets a fraction of a core, and the
    # case below is about the CPU limit stopping it (the wall timeout has its own test in test_sandbox.py).
    env = CodeWriterTester(CodeOptions(wall_seconds=60.0))
    task = next(t for t in env.sample_tasks(__import__("numpy").random.default_rng(0), 50) if t["id"] == "add")
    cases = [  # (writer code, tester continuation) -> outcomes, rewards
        (("def add(a, b):\n    return a + b", "add(1, 1) == 2\nassert add(2, 2) == 4"),
         ("all_passed", "all_passed"), {"writer": 1.0, "tester": 1.0}),
        (("def add(a, b):\n    return a * b", "add(1, 1) == 3\nassert add(2, 2) == 4"),  # 0*0 passes 1 of 3
         ("some_passed", "some_passed"), {"writer": 1 / 3, "tester": 0.5}),
        (("def add(a, b):\n    while True: pass", "nonsense"), ("sandbox_cpu_limit", "none_passed"),
         {"writer": 0.0, "tester": 0.0}),
        (("import os\nos.system('id')", ""), ("none_passed", "no_tests"), {"writer": 0.0, "tester": 0.0}),
    ]
    for (code, tests), outcomes, rewards in cases:
        transcript = [Turn("writer", code), Turn("tester", tests)]
        results = env.execute(task, transcript)
        assert tuple(r.outcome for r in results) == outcomes, (code, [r.info for r in results])
        assert env.score(task, transcript, results) == pytest.approx(rewards)


class GuessNumber:
    """Tests-only plugin: the guesser guesses a hidden number three times; after each guess the environment
    replies higher/lower/correct, and the next guess's prompt shows that reply (a multi-turn episode whose
    next turn depends on the environment's reply). Its ``observe`` raises for tasks marked ``broken``."""

    name = "guess_number"
    turn_order = ("guesser", "guesser", "guesser")

    class Options(__import__("pydantic").BaseModel):
        pass

    def __init__(self, options) -> None:
        pass

    def sample_tasks(self, rng, count):
        return [{"id": f"s{i}", "secret": int(rng.integers(0, 10)), "broken": i == 1} for i in range(count)]

    def render_prompt(self, role, task, transcript):
        return "1+2=" + "".join(f"{t.text.strip()[:3]}:{t.observation}," for t in transcript)

    def observe(self, role, task, transcript):
        if task["broken"]:
            raise RuntimeError("the hidden number went missing")
        guess = transcript[-1].text.strip()
        if not guess.isdigit():
            return "not a number"
        return "correct" if int(guess) == task["secret"] else "higher" if int(guess) < task["secret"] else "lower"

    def execute(self, task, transcript):
        return [ActionResult("found" if t.observation == "correct" else "missed", t.observation == "correct")
                for t in transcript]

    def score(self, task, transcript, results):
        return {"guesser": float(any(r.success for r in results))}

    def text_corpus(self, rng, count):
        return []

    def warmup_examples(self, role, rng, count):
        return []


def test_observe_replies_between_turns_through_the_real_engine(engine) -> None:
    env = GuessNumber(None)
    rollouts, results, rewards = _episode(env, engine, None)
    rows = rollouts.sort_by([("episode", "ascending"), ("turn", "ascending")]).to_pylist()
    assert len(rows) == 2 * 2 * 3
    for row in rows:
        task = json.loads(row["task"])
        if task["broken"]:  # the plugin's reply raised: recorded on the turn, the episode goes on
            assert row["status"] == "observe_failed" and row["observation"] is None
            assert row["error"] == "observe: RuntimeError: the hidden number went missing"
            continue
        guess = row["response_text"].strip()
        expected = ("not a number" if not guess.isdigit() else "correct" if int(guess) == task["secret"]
                    else "higher" if int(guess) < task["secret"] else "lower")
        assert row["status"] == "ok" and row["observation"] == expected
    for earlier, later in itertools.pairwise(rows):
        if later["episode"] == earlier["episode"] and not json.loads(later["task"])["broken"]:
            # The next turn's prompt carries the environment's reply to the previous one.
            assert later["prompt_text"].endswith(f"{earlier['response_text'].strip()[:3]}:{earlier['observation']},")
    statuses = {(r["episode"], r["status"]) for r in results.to_pylist()}
    broken = {row["episode"] for row in rows if json.loads(row["task"])["broken"]}
    assert broken and all(status == ("failed" if e in broken else "ok") for e, status in statuses)
    for row in rewards.to_pylist():
        if row["episode"] in broken:
            assert row["status"] == "failed" and row["reward"] == 0.0


class WhereMathRuns(MathSolverVerifier):
    """The math environment, recording which process ran each action (to see the train job use the pool)."""

    name = "math_where"

    def run_action(self, action):
        import os

        result = super().run_action(action)
        return ActionResult(result.outcome, result.success, result.observation, {**result.info, "pid": os.getpid()})


@pytest.mark.launch
def test_train_job_runs_actions_on_the_pool_and_scores_with_the_reward_model(local_ray, demo_config_data,
                                                                             tmp_path) -> None:
    """configs/math_reward_model.yaml cut down to one step: every action ran on a pool worker (another
    process), every episode has the environment's reply before the revision, and the solver's final turn
    has a model score."""
    import os

    import yaml

    from marl_pipeline.config import parse_config
    from marl_pipeline.environment import register_environment
    from marl_pipeline.run.recipe import train
    from marl_pipeline.store import ExperienceStore
    from tests.conftest import ROOT, small_config_data

    register_environment(WhereMathRuns)
    data = yaml.safe_load((ROOT / "configs" / "math_reward_model.yaml").read_text())
    data["environment"]["name"] = "math_where"
    data["environment"]["pool"] = {"min_workers": 1, "max_workers": 2, "num_cpus": 0}
    data["reward_model"].update(train_steps=20, num_cpus=0)
    data = small_config_data(data, tmp_path / "store", steps=1, micro_batches_per_step=1)
    for agent in data["agents"].values():  # the module's engine holds 0.5 of the 2 CPUs
        agent.update(engine={"num_cpus": 0.25}, trainer={"num_cpus": 0.25})
    config = parse_config(data)
    list(train(config))
    store = ExperienceStore(config.store)
    results = store.read_stage(config.run, "environment_results").to_pylist()
    assert len(results) == 4 * 4 * 3 and {r["status"] for r in results} == {"ok"}
    pids = {json.loads(r["info"])["pid"] for r in results}
    assert os.getpid() not in pids  # ran on the action pool's workers, not in the driver
    rollouts = store.read_stage(config.run, "rollouts").to_pylist()
    assert {r["observation"] for r in rollouts if r["turn"] == 1} <= {"Verdict: correct", "Verdict: wrong",
                                                                      "Verdict: unreadable"}
    assert all(r["observation"] is None for r in rollouts if r["turn"] != 1)
    assert all("Verdict: " in r["prompt_text"] for r in rollouts if r["turn"] == 2)
    rewards = store.read_stage(config.run, "rewards").to_pylist()
    scored = {(r["episode"], r["turn"]) for r in rewards if r["model_score"] is not None}
    assert scored == {(r["episode"], 2) for r in rewards if r["agent"] == "solver"}
