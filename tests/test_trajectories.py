"""Trajectory-level rollout on a real asynchronous engine actor: a slow episode holds only itself, a time limit
cuts it without holding the micro-batch's commit, and the stored rows are those of the turn-batched rollout. A prompt
over the engine's context fails its episode, or its held-out case, alone."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from marl_pipeline.cluster.spawn import engine_actor
from marl_pipeline.config import EngineConfig, GRPOAdvantage, RolloutConfig
from marl_pipeline.environment import EvaluationCase, Turn
from marl_pipeline.inference.async_engine import AsyncRolloutEngine
from marl_pipeline.stages.evaluation import EvaluationSettings, evaluate_agent, with_metrics
from marl_pipeline.stages.execution import execute_micro_batch
from marl_pipeline.stages.health import REWARD_COLUMNS, ROLLOUT_COLUMNS, health_table
from marl_pipeline.stages.reward import score_micro_batch
from marl_pipeline.stages.rollout import RolloutSettings, episode_tasks, turn_seeds
from marl_pipeline.stages.team import evaluate_team
from marl_pipeline.stages.training import train_batch_for
from marl_pipeline.stages.trajectories import rollout_trajectories
from marl_pipeline.store import ExperienceStore, MicroBatchKey
from marl_pipeline.store.inspection import inspect_run
from marl_pipeline.store.schema import EVALUATIONS, with_agent, with_stage_timing
from marl_pipeline.store.summaries import stage_summary
from tests.timed_replies import ChosenReplies, TimedReplies
from tests.turn_batched import rollout_micro_batch  # the baseline the trajectory rollout is compared with

SLOW_REPLY_S = 1.5  # far above a fast episode's turn (milliseconds), short for the suite


SETTINGS = RolloutSettings(seed=3, prompts_per_micro_batch=4, samples_per_prompt=2,
                           max_new_tokens={"writer": 6, "checker": 6}, temperature={"writer": 1.0, "checker": 1.0})


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


@pytest.mark.launch
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


@pytest.mark.launch
def test_an_episode_over_its_time_limit_is_cut_and_does_not_hold_the_commit(engines, tmp_path: Path) -> None:
    key, store = MicroBatchKey("limit", 0, 0), ExperienceStore(tmp_path / "store")
    env = TimedReplies(slow_s=40.0)
    started = time.time()
    table = rollout_trajectories(env, engines, key, SETTINGS, RolloutConfig(episode_timeout_s=5.0))
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
        assert "time limit of 5 s" in turns[0]["error"] and "with 0 of 3 turns and their replies" in turns[0]["error"]
    for e, turns in episodes.items():
        if e not in slow:
            assert [row["status"] for row in turns] == ["ok"] * 3
            assert turns[-1]["rollout_end"].timestamp() - started < 5.0

    # Downstream, a cut episode is a failed one: it earns nothing, and stays in its GRPO group.
    results = execute_micro_batch(env, stored)
    failed = {row["episode"] for row in results.to_pylist() if row["status"] == "failed"}
    assert failed == set(slow)
    rewards = score_micro_batch(env, stored, results, advantage=GRPOAdvantage(eps=1e-6)).to_pylist()
    assert all(row["reward"] == 0.0 for row in rewards if row["episode"] in slow)
    assert {row["group_id"] for row in rewards if row["episode"] in slow} == {"0-0-0"}


class OutgrownContext(TimedReplies):
    """Task 0's conversation outgrows the engine's 128 tokens at its second turn, as a long game's history would."""

    def render_prompt(self, role: str, task: dict, transcript: list) -> str:
        prompt = super().render_prompt(role, task, transcript)
        return prompt + " 1+1=2" * 60 if task["id"] == 0 and transcript else prompt


@pytest.mark.launch
def test_an_episode_whose_prompt_outgrows_the_context_fails_alone(engines) -> None:
    """vLLM refuses a prompt over ``max_model_len``: that episode fails there, the micro-batch goes on (the launch
    stopped on it before)."""
    env, key = OutgrownContext(), MicroBatchKey("outgrown", 0, 0)
    stored = rollout_trajectories(env, engines, key, SETTINGS, RolloutConfig())
    episodes = by_episode(stored)
    outgrown = {e: turns for e, turns in episodes.items() if turns[0]["task_id"] == "0"}
    assert len(outgrown) == 2 and len(episodes) == 8
    for turns in outgrown.values():  # its first turn sampled and replied to, its second never sent
        assert [(row["turn"], row["status"]) for row in turns] == [(0, "prompt_too_long")]
        assert "turn 1's prompt is over max_model_len" in turns[0]["error"]
        assert "maximum context length is 128" in turns[0]["error"]
    assert all([row["status"] for row in turns] == ["ok"] * 3 for e, turns in episodes.items() if e not in outgrown)
    results = execute_micro_batch(env, stored)
    assert {row["episode"] for row in results.to_pylist() if row["status"] == "failed"} == set(outgrown)


class OutgrownCase(TimedReplies):
    """Held-out cases of additions, one of which (task 0) outgrows the engine's 128 tokens: in its first prompt for
    the writer, and in the team's episodes from the checker's turn (the writer's reply is shown it again)."""

    answering_role = "writer"

    def evaluation_cases(self, role: str, rng, count: int) -> list[EvaluationCase]:
        return [EvaluationCase(task, [], str(task["a"] + task["b"])) for task in self.sample_tasks(rng, count)]

    def evaluate(self, role: str, cases: list[EvaluationCase], responses: list[str]) -> dict[str, float]:
        return {"answered": float(np.mean([response != "" for response in responses]))}

    def answer_of(self, role: str, response: str) -> str:
        return response.strip()

    def render_prompt(self, role: str, task: dict, transcript: list) -> str:
        prompt = super().render_prompt(role, task, transcript)
        long = task["id"] == 0 and ((role == "writer" and not transcript) or role == "checker")
        return prompt + " 1+1=2" * 60 if long else prompt

    def team_choice(self, task: dict, episodes: list[list[Turn]]) -> int:
        return 0


@pytest.mark.launch
def test_an_evaluation_scores_a_case_over_the_context_and_goes_on(engines) -> None:
    """A held-out case whose prompt the engine cannot hold is stored unanswered, with why; the others are answered
    as before (the evaluation failed whole before)."""
    env = OutgrownCase()
    settings = EvaluationSettings(seed=0, cases_per_agent=4, max_new_tokens={"writer": 4, "checker": 4},
                                  turn_adapters={}, team_samples=2, temperature={"writer": 1.0, "checker": 1.0})
    rows = evaluate_agent(env, "writer", engines["writer"], settings).to_pylist()
    assert [row["status"] for row in rows] == ["prompt_too_long", "ok", "ok", "ok"]
    assert rows[0]["response_text"] == "" and "maximum context length is 128" in rows[0]["error"]
    assert all(row["response_text"] for row in rows[1:]) and {row["policy_version"] for row in rows} == {0}
    assert with_metrics(env, pa.Table.from_pylist(rows, schema=with_agent(EVALUATIONS)))[1]["writer"][
        "answered"] == 0.75
    # The team: task 0's first prompt is refused, then its checker's; the writer's third turn is short again
    team = evaluate_team(env, engines, settings).to_pylist()
    assert [row["status"] for row in team] == ["prompt_too_long", "ok", "ok", "ok"]
    assert team[0]["error"].count("maximum context length is 128") == 4  # 2 episodes, 2 turns refused in each
    assert "turn 0 (writer)" in team[0]["error"] and "turn 1 (checker)" in team[0]["error"]
    for episode in json.loads(team[0]["transcript"]):
        assert [(turn["role"], turn["text"]) for turn in episode][:2] == [("writer", ""), ("checker", "")]
        assert len(episode) == 3 and episode[2]["text"]  # the third prompt fits: answered
    assert all(json.loads(row["transcript"])[0][0]["text"] for row in team[1:])


def test_the_stored_rows_are_those_of_the_turn_batched_rollout(engines) -> None:
    key, env = MicroBatchKey("same", 2, 1), TimedReplies()
    trajectory = rollout_trajectories(env, engines, key, SETTINGS, RolloutConfig()).to_pylist()
    batched = rollout_micro_batch(env, engines, key, SETTINGS).to_pylist()
    timing = {"rollout_start", "rollout_end", "engine_seconds", "observe_seconds", "logprobs"}
    assert [{k: v for k, v in row.items() if k not in timing} for row in trajectory] == \
        [{k: v for k, v in row.items() if k not in timing} for row in batched]
    for ours, theirs in zip(trajectory, batched):
        assert ours["logprobs"] == pytest.approx(theirs["logprobs"], abs=1e-5)
        assert ours["observe_seconds"] >= 0 and theirs["observe_seconds"] >= 0  # both time the reply


def test_observe_on_the_action_pool_needs_a_pool(engines) -> None:
    with pytest.raises(ValueError, match="observe_on is 'action_pool' but the run has no action pool"):
        rollout_trajectories(TimedReplies(), engines, MicroBatchKey("x", 0, 0), SETTINGS,
                             RolloutConfig(observe_on="action_pool"))


def test_rollout_settings_are_checked() -> None:
    with pytest.raises(ValueError, match=r"pipeline\.rollout\.mode is gone: trajectory-level rollout is the one"):
        RolloutConfig.model_validate({"mode": "turn_batched"})
    with pytest.raises(ValueError, match="greater than 0"):
        RolloutConfig(episode_timeout_s=0)
    with pytest.raises(ValueError, match=r"oversample must be an int k >= 0 \(extra episodes per group\), got -1"):
        RolloutConfig(oversample=-1)
    for fraction in (1.5, 0.0, float("nan")):
        with pytest.raises(ValueError, match=r"oversample as a fraction of samples_per_prompt must be in \(0, 1\]"):
            RolloutConfig(oversample=fraction)
    with pytest.raises(ValueError, match="oversample must be an int k >= 0 or a fraction in"):
        RolloutConfig(oversample=True)
    # k extra episodes, or a fraction of n rounded up
    assert [RolloutConfig(oversample=v).extra_episodes(16) for v in (0, 3, 0.1, 0.25, 1.0)] == [0, 3, 2, 4, 16]


def test_oversampled_episodes_come_after_every_prompts_n_with_the_same_seeds() -> None:
    """The first n episodes of each prompt keep their numbers, and so their seeds, whatever k is: oversample 0 stores
    what it stored before the option existed."""
    env, tasks, key = TimedReplies(), [{"id": 0}, {"id": 1}], MicroBatchKey("r", 3, 1)
    plain, over = episode_tasks(env, tasks, 2), episode_tasks(env, tasks, 2, extra=2)
    assert [(p, t) for p, t, _ in over] == [(0, 0), (0, 1), (1, 0), (1, 1), (0, 2), (0, 3), (1, 2), (1, 3)]
    assert over[:4] == plain
    assert turn_seeds(3, key, 1, 8)[:4] == turn_seeds(3, key, 1, 4)


def _stored(store: ExperienceStore, key: MicroBatchKey, env, table) -> tuple:
    """The micro-batch's rollouts, environment results and rewards, committed as the pipeline commits them."""
    now = time.time()
    store.commit("rollouts", key, with_stage_timing(table, now, now, now))
    rollouts = store.read("rollouts", key)
    results = execute_micro_batch(env, rollouts)
    rewards = score_micro_batch(env, rollouts, results, advantage=GRPOAdvantage(eps=1e-6))
    store.commit("environment_results", key, with_stage_timing(results, now, now, now))
    store.commit("rewards", key, with_stage_timing(rewards, now, now, now))
    return rollouts, results, rewards


def _health(rollouts, rewards) -> dict:
    rows = health_table(rollouts.select(ROLLOUT_COLUMNS).to_pylist(), rewards.select(REWARD_COLUMNS).to_pylist(), [],
                        {"writer": 1, "checker": 1}, {}).to_pylist()
    return {row["agent"]: row for row in rows}


def test_oversampling_keeps_the_first_n_that_finish_and_stores_the_rest_dropped(engines, tmp_path: Path) -> None:
    """n = 2 of 3 episodes per prompt: task 0's first episode hangs in its first reply, and its group does not wait
    for it; in every group the slowest episode is cut, stored with why, and neither executed, scored nor trained."""
    key, store, env = MicroBatchKey("over", 0, 0), ExperienceStore(tmp_path / "store"), ChosenReplies(hang={(0, 0)})
    started = time.monotonic()
    table = rollout_trajectories(env, engines, key, SETTINGS, RolloutConfig(oversample=1))
    assert time.monotonic() - started < env.hang_s / 2  # no wait for the hung reply, nor a time limit to cut it
    rollouts, results, rewards = _stored(store, key, env, table)

    episodes = by_episode(rollouts)
    kept = {e: turns for e, turns in episodes.items() if turns[0]["status"] != "dropped"}
    dropped = {e: turns for e, turns in episodes.items() if e not in kept}
    by_group = {group: sorted(turns[0]["trajectory"] for turns in kept.values() if turns[0]["group_id"] == group)
                for group in {row["group_id"] for row in rollouts.to_pylist()}}
    assert all(len(trajectories) == 2 for trajectories in by_group.values()) and len(by_group) == 4, by_group
    assert by_group["0-0-0"] == [1, 2]  # the hung one is the one cut
    assert all([row["status"] for row in turns] == ["ok"] * 3 for turns in kept.values())
    for turns in dropped.values():  # cut in flight: its sampled turns stored, each with why
        assert {row["status"] for row in turns} == {"dropped"}
        assert all("dropped: its group had 2 finished episodes first (pipeline.rollout.oversample); cut with"
                   in row["error"] for row in turns)
    (hung,) = [turns for turns in dropped.values() if turns[0]["group_id"] == "0-0-0"]
    assert [row["turn"] for row in hung] == [0] and hung[0]["observation"] is None
    assert "cut with 0 of 3 turns and their replies done" in hung[0]["error"]
    assert set(rollouts.column("group_shortfall").to_pylist()) == {0}
    assert set(rollouts.column("group_dropped").to_pylist()) == {1}

    # Downstream only the kept: no environment or reward row for a dropped turn, two episodes in each group's
    # statistics, and the trainer's shard is the kept rows.
    kept_ids = {row["sample_id"] for turns in kept.values() for row in turns}
    assert set(results.column("sample_id").to_pylist()) == kept_ids == set(rewards.column("sample_id").to_pylist())
    assert all(row["status"] == "ok" for row in rewards.to_pylist())
    writer_rows = sum(row["agent"] == "writer" for turns in kept.values() for row in turns)
    assert len(train_batch_for(store, key, "writer").prompt_ids) == writer_rows == 16
    health = _health(rollouts, rewards)
    assert all((row["short_groups"], row["shortfall"], row["dropped_episodes"]) == (0, 0, 4)
               for row in health.values())
    assert health["writer"]["groups"] == 4
    # What `marl inspect` and the stage's metadata say: dropped turns, apart from failures.
    dropped_turns = sum(len(turns) for turns in dropped.values())
    report = inspect_run(store, "over")
    assert report["dropped"]["rollouts"]["rows"] == dropped_turns and report["failures"] == {}
    assert stage_summary("rollouts", rollouts)["dropped_turns"] == dropped_turns
    assert stage_summary("rollouts", rollouts)["failed_rows"] == 0


@pytest.mark.launch
def test_a_group_short_of_n_keeps_failed_episodes_up_to_n_and_records_its_shortfall(engines, tmp_path: Path) -> None:
    """Task 0: two of three episodes hang past the time limit, so one finishes: it keeps the first that timed out,
    drops the second, and is one short. Task 1: an episode whose reply raised is dropped, its group full without it."""
    key, store = MicroBatchKey("short", 0, 0), ExperienceStore(tmp_path / "store")
    env = ChosenReplies(hang={(0, 0), (0, 1)}, fail={(1, 0)})
    started = time.monotonic()
    table = rollout_trajectories(env, engines, key, SETTINGS, RolloutConfig(oversample=1, episode_timeout_s=4.0))
    assert time.monotonic() - started < env.hang_s / 2
    rollouts, _, rewards = _stored(store, key, env, table)

    first = {(turns[0]["group_id"], turns[0]["trajectory"]): turns for turns in by_episode(rollouts).values()}
    assert [row["status"] for row in first["0-0-0", 0]] == ["timeout"]  # kept: the group's n-th episode, failed
    assert [row["status"] for row in first["0-0-0", 1]] == ["dropped"]
    assert "with 1 of 2 episodes finished, kept 1 failed ones before it; it failed: episode over its time limit" in \
        first["0-0-0", 1][0]["error"]
    assert [row["status"] for row in first["0-0-0", 2]] == ["ok"] * 3
    assert {row["status"] for row in first["0-0-1", 0]} == {"dropped"}
    assert "its group had 2 finished episodes first (pipeline.rollout.oversample); it failed: observe: RuntimeError: " \
        "episode (1, 0) fails" in \
        first["0-0-1", 0][0]["error"]
    shortfall = {row["group_id"]: row["group_shortfall"] for row in rollouts.to_pylist()}
    assert shortfall == {"0-0-0": 1, "0-0-1": 0, "0-0-2": 0, "0-0-3": 0}
    assert set(rollouts.column("group_dropped").to_pylist()) == {1}

    # The kept timed-out episode is in its group as a failed one, as without over-sampling; the dropped are not.
    scored = {(row["group_id"], row["trajectory"]): row["status"] for row in rewards.to_pylist()}
    assert {t: status for (group, t), status in scored.items() if group == "0-0-0"} == {0: "failed", 2: "ok"}
    assert sorted(t for group, t in scored if group == "0-0-1") == [1, 2]
    health = _health(rollouts, rewards)
    assert all((row["short_groups"], row["shortfall"], row["dropped_episodes"]) == (1, 1, 4)
               for row in health.values())
