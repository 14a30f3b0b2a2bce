"""Trajectory-level rollout on a real asynchronous engine actor: a slow episode holds only itself, a time limit
cuts it without holding the micro-batch's commit, and the stored rows are those of the turn-batched rollout."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from bench.turn_batched import rollout_micro_batch  # the baseline the trajectory rollout is compared with
from marl_pipeline.cluster.spawn import engine_actor
from marl_pipeline.config import EngineConfig, GRPOAdvantage, RolloutConfig
from marl_pipeline.inference.async_engine import AsyncRolloutEngine
from marl_pipeline.stages.execution import execute_micro_batch
from marl_pipeline.stages.reward import score_micro_batch
from marl_pipeline.stages.rollout import RolloutSettings
from marl_pipeline.stages.trajectories import rollout_trajectories
from marl_pipeline.store import ExperienceStore, MicroBatchKey
from marl_pipeline.store.schema import with_stage_timing
from tests.timed_replies import TimedReplies

SLOW_REPLY_S = 3.0


SETTINGS = RolloutSettings(seed=3, prompts_per_micro_batch=4, samples_per_prompt=2, max_new_tokens=6, temperature=1.0)


@pytest.fixture(scope="module")
def engines(local_ray, tiny_model_dir: Path):
    # One engine serves both roles: never more than one vLLM engine at a time on the test machine.
    handle = engine_actor(EngineConfig(), actor_class=AsyncRolloutEngine).remote(
        str(tiny_model_dir), 0, gpu_memory_utilization=0.15, max_model_len=128, dtype="float32", seed=0, threads=1)
    local_ray.get(handle.policy_version.remote())
    yield {"writer": handle, "checker": handle}
    local_ray.kill(handle)


def by_episode(table) -> dict[int, list[dict]]:
    episodes: dict[int, list[dict]] = {}
    for row in table.sort_by([("episode", "ascending"), ("turn", "ascending")]).to_pylist():
        episodes.setdefault(row["episode"], []).append(row)
    return episodes


def test_a_slow_reply_holds_only_its_own_episode(engines) -> None:
    key = MicroBatchKey("slow", 0, 0)
    env = TimedReplies(slow_s=SLOW_REPLY_S)
    trajectory = by_episode(rollout_trajectories(env, engines, key, SETTINGS, RolloutConfig()))
    slow = [e for e, turns in trajectory.items() if turns[0]["task_id"] == "0"]
    fast = [e for e in trajectory if e not in slow]
    assert len(slow) == 2 and len(fast) == 6 and all(len(turns) == 3 for turns in trajectory.values())
    # A turn's rollout_end is after the environment's reply to it: every other episode asked for its second turn
    # before the slow episodes' first replies came back.
    assert max(trajectory[e][1]["rollout_start"] for e in fast) < min(trajectory[e][0]["rollout_end"] for e in slow)

    # The control, on the same engine: turn-batched, every episode's second turn waits for the slow reply.
    batched = by_episode(rollout_micro_batch(env, engines, key, SETTINGS))
    assert min(batched[e][1]["rollout_start"] for e in fast) >= max(batched[e][0]["rollout_end"] for e in slow)


def test_an_episode_over_its_time_limit_is_cut_and_does_not_hold_the_commit(engines, tmp_path: Path) -> None:
    key, store = MicroBatchKey("limit", 0, 0), ExperienceStore(tmp_path / "store")
    env = TimedReplies(slow_s=40.0)
    started = time.time()
    table = rollout_trajectories(env, engines, key, SETTINGS, RolloutConfig(episode_timeout_s=10.0))
    store.commit("rollouts", key, with_stage_timing(table, started, started, time.time()))

    stored = store.read("rollouts", key)
    committed_at = stored.column("stage_ended")[0].as_py().timestamp()
    assert committed_at - started < 25.0  # the 40 s replies did not hold the micro-batch
    episodes = by_episode(stored)
    slow = {e: turns for e, turns in episodes.items() if turns[0]["task_id"] == "0"}
    assert len(slow) == 2 and len(episodes) == 8
    for turns in slow.values():  # its first turn was sampled, its reply never came
        assert [row["turn"] for row in turns] == [0] and turns[0]["status"] == "timeout"
        assert turns[0]["response_ids"] and turns[0]["observation"] is None
        assert "time limit of 10 s" in turns[0]["error"] and "with 0 of 3 turns and their replies" in turns[0]["error"]
    for e, turns in episodes.items():
        if e not in slow:
            assert [row["status"] for row in turns] == ["ok"] * 3
            assert turns[-1]["rollout_end"].timestamp() - started < 10.0

    # Downstream, a cut episode is a failed one: it earns nothing, and stays in its GRPO group.
    results = execute_micro_batch(env, stored)
    failed = {row["episode"] for row in results.to_pylist() if row["status"] == "failed"}
    assert failed == set(slow)
    rewards = score_micro_batch(env, stored, results, advantage=GRPOAdvantage(eps=1e-6)).to_pylist()
    assert all(row["reward"] == 0.0 for row in rewards if row["episode"] in slow)
    assert {row["group_id"] for row in rewards if row["episode"] in slow} == {"0-0-0"}


def test_the_stored_rows_are_those_of_the_turn_batched_rollout(engines) -> None:
    key, env = MicroBatchKey("same", 2, 1), TimedReplies()
    trajectory = rollout_trajectories(env, engines, key, SETTINGS, RolloutConfig()).to_pylist()
    batched = rollout_micro_batch(env, engines, key, SETTINGS).to_pylist()
    timing = {"rollout_start", "rollout_end", "engine_seconds", "logprobs"}
    assert [{k: v for k, v in row.items() if k not in timing} for row in trajectory] == \
        [{k: v for k, v in row.items() if k not in timing} for row in batched]
    for ours, theirs in zip(trajectory, batched):
        assert ours["logprobs"] == pytest.approx(theirs["logprobs"], abs=1e-5)


def test_observe_on_the_action_pool_needs_a_pool(engines) -> None:
    with pytest.raises(ValueError, match="observe_on is 'action_pool' but the run has no action pool"):
        rollout_trajectories(TimedReplies(), engines, MicroBatchKey("x", 0, 0), SETTINGS,
                             RolloutConfig(observe_on="action_pool"))


def test_rollout_settings_are_checked() -> None:
    with pytest.raises(ValueError, match=r"pipeline\.rollout\.mode is gone: trajectory-level rollout is the one"):
        RolloutConfig.model_validate({"mode": "turn_batched"})
    with pytest.raises(ValueError, match="greater than 0"):
        RolloutConfig(episode_timeout_s=0)
