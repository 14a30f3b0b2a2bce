"""Real episodes of the shipped environments through a real vLLM engine on CPU, the real pool and sandbox.

The built-in tiny model was trained on the demo's text, so its samples here are mostly garbage: the
hand-checked outcomes are in test_credit_and_actions.py and below (hand-written code); these tests check
that real episodes are recorded with one outcome per turn from the environment's own labels.
"""

from __future__ import annotations

import pytest

from environments.code_tester import CodeOptions, CodeWriterTester
from environments.math_verifier import MathOptions, MathSolverVerifier
from marl_pipeline.action_pool import ActionPool, PoolSettings
from marl_pipeline.engine import ENGINE_ENV, RolloutEngine
from marl_pipeline.environment import Turn
from marl_pipeline.execution import execute_micro_batch
from marl_pipeline.reward import score_micro_batch
from marl_pipeline.rollout import RolloutSettings, rollout_micro_batch
from marl_pipeline.store import MicroBatchKey


@pytest.fixture(scope="module")
def engine(local_ray, tiny_model_dir):
    actor = local_ray.remote(RolloutEngine).options(num_cpus=0.5, runtime_env={"env_vars": ENGINE_ENV})
    handle = actor.remote(str(tiny_model_dir), 0, gpu_memory_utilization=0.15, max_model_len=256, dtype="float32",
                          seed=0)
    yield handle
    local_ray.kill(handle)


SETTINGS = RolloutSettings(seed=0, prompts_per_micro_batch=2, samples_per_prompt=2, max_new_tokens=8, temperature=1.0)


def _episode(env, engine, pool):
    rollouts = rollout_micro_batch(env, {role: engine for role in env.turn_order}, MicroBatchKey("t", 0, 0), SETTINGS)
    results = execute_micro_batch(env, rollouts, pool=pool)
    rewards = score_micro_batch(env, rollouts, results, 1e-6)
    return rollouts, results, rewards


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


def test_code_writer_tester_by_hand() -> None:
    env = CodeWriterTester(CodeOptions())
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
