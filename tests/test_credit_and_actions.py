"""Credit assignment by hand, and malformed or failing actions recorded per turn without stopping the batch."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest

from environments.math_verifier import MathOptions, MathSolverVerifier
from marl_pipeline.config import GRPOAdvantage
from marl_pipeline.environment import Action, Turn
from marl_pipeline.stages.credit import assign_credit
from marl_pipeline.stages.execution import execute_micro_batch
from marl_pipeline.stages.reward import score_micro_batch
from marl_pipeline.store.schema import ROLLOUTS, SCHEMA_VERSION, with_agent

GRPO = GRPOAdvantage(eps=1e-9)


def test_credit_assignment_by_hand() -> None:
    own = {"solver": 1.0, "verifier": 0.0}
    assert assign_credit(own, 0.0) == {"solver": 1.0, "verifier": 0.0}  # individual
    assert assign_credit(own, 1.0) == {"solver": 0.5, "verifier": 0.5}  # shared team reward (mean 0.5)
    # mix 0.25: 0.25 * 0.5 + 0.75 * own
    assert assign_credit(own, 0.25) == pytest.approx({"solver": 0.875, "verifier": 0.125})
    with pytest.raises(ValueError, match="team_weight"):
        assign_credit(own, 1.5)


def rollouts_of(env, task: dict, episodes: list[list[str]], groups: list[str] | None = None) -> pa.Table:
    """A rollouts table of hand-written episodes of one task (the transcript texts only matter here), one GRPO group
    unless ``groups`` names each episode's."""
    rows = []
    for e, texts in enumerate(episodes):
        for turn, (role, text) in enumerate(zip(env.turn_order, texts)):
            rows.append({"sample_id": f"0-0-0_{turn}_{e}", "episode": e, "task_id": task["id"],
                         "group_id": groups[e] if groups else "0-0-0", "trajectory": e,
                         "role": role, "turn": turn, "task": json.dumps(task), "policy_version": 0, "engine": "x",
                         "prompt_text": "", "response_text": text, "prompt_ids": [], "response_ids": [],
                         "logprobs": [], "finish_reason": "stop", "rollout_start": None, "rollout_end": None,
                         "status": "ok", "error": None, "agent": role})
    return pa.Table.from_pylist(rows, schema=with_agent(ROLLOUTS))


class _Malformed(MathSolverVerifier):
    """Turns whose text asks for a bad action: a fault the model can't produce as a str (bytes, surrogates)."""

    def actions(self, task, transcript):
        actions = super().actions(task, transcript)
        bad = {"bytes": Action("answer", b"\xff\xfe", 0.1, {}), "int": 7, "big": Action("answer", "9" * 70_000),
               "surrogate": Action("answer", "\udcff", 0.1, {})}
        return [bad.get(t.text, a) for t, a in zip(transcript, actions)]


def test_malformed_actions_are_recorded_and_the_batch_goes_on() -> None:
    env = _Malformed(MathOptions())
    task = {"id": "q", "question": "2+3?", "answer": 5}
    rollouts = rollouts_of(env, task, [["bytes", "correct", "5"], ["4", "wrong", "int"], ["big", "wrong", "5"],
                                       ["5", "correct", "surrogate"]])
    results = execute_micro_batch(env, rollouts).sort_by([("episode", "ascending"), ("turn", "ascending")])
    errors = results.column("error").to_pylist()
    assert errors[0] == "malformed action: invalid UTF-8 in payload at byte 0"
    assert errors[5] == "malformed action: wrong type: expected Action or None, got int"
    assert errors[6] == "malformed action: oversized payload: 70000 bytes > 65536"
    assert errors[11] == "malformed action: invalid UTF-8 in payload at character 0"
    assert results.column("outcome").to_pylist()[:3] == ["malformed_action", "wrong_verdict", "correct"]
    statuses = results.column("status").to_pylist()
    assert statuses.count("action_failed") == 4 and statuses.count("failed") == 0
    rewards = score_micro_batch(env, rollouts, results, advantage=GRPO)
    rewards = rewards.sort_by([("episode", "ascending"), ("turn", "ascending")])
    # Episode 0: final answer right (solver 1); first answer malformed so it counts as not correct: verdict
    # "correct" is wrong (verifier 0). Episodes go on being scored.
    assert rewards.column("reward").to_pylist()[:3] == [1.0, 0.0, 1.0]
    assert set(rewards.column("status").to_pylist()) == {"ok"}


def test_math_outcomes_and_rewards_by_hand() -> None:
    env = MathSolverVerifier(MathOptions(team_reward_weight=0.5))
    task = {"id": "q", "question": "Ann has 2 apples and gets 3 more. How many apples?", "answer": 5}
    assert env.render_prompt("verifier", task, [Turn("solver", "4")]).endswith("A: 4\nCheck: ")
    assert env.render_prompt("solver", task, [Turn("solver", "4"), Turn("verifier", "wrong, recount")]).endswith(
        "Check: wrong, recount\nFinal: ")
    # The environment's reply to the verifier's turn, and the revision prompt that shows it.
    assert env.observe("solver", task, [Turn("solver", "4")]) is None
    assert env.observe("verifier", task, [Turn("solver", "4"), Turn("verifier", "WRONG recount")]) == "Verdict: wrong"
    assert env.observe("verifier", task, [Turn("solver", "4"), Turn("verifier", "hmm")]) == "Verdict: unreadable"
    replied = [Turn("solver", "4"), Turn("verifier", "wrong, recount", "Verdict: unreadable")]
    assert env.render_prompt("solver", task, replied).endswith("Check: wrong, recount\nVerdict: unreadable\nFinal: ")
    cases = [  # (solver, verifier, revision) -> outcomes, own rewards
        (("5", "correct", "5"), ("correct", "right_verdict", "correct"), {"solver": 1.0, "verifier": 1.0}),
        (("4", "wrong add", "5"), ("wrong", "right_verdict", "correct"), {"solver": 1.0, "verifier": 1.0}),
        (("4", "correct", "4"), ("wrong", "wrong_verdict", "wrong"), {"solver": 0.0, "verifier": 0.0}),
        (("5", "wrong", "x"), ("correct", "wrong_verdict", "unparsable"), {"solver": 0.0, "verifier": 0.0}),
        (("x", "wrong", "5"), ("unparsable", "right_verdict", "correct"), {"solver": 1.0, "verifier": 1.0}),
        (("4", "maybe", "4"), ("wrong", "unparsable", "wrong"), {"solver": 0.0, "verifier": 0.0}),
    ]
    for texts, outcomes, own in cases:
        transcript = [Turn(r, t) for r, t in zip(env.turn_order, texts)]
        results = env.execute(task, transcript)
        assert tuple(r.outcome for r in results) == outcomes, texts
        assert env.score(task, transcript, results) == own
    # The mix through the reward stage: solver right, verifier wrong -> 0.5 * 0.5 + 0.5 * own.
    rollouts = rollouts_of(env, task, [["5", "wrong", "5"], ["4", "wrong", "4"]])
    rewards = score_micro_batch(env, rollouts, execute_micro_batch(env, rollouts), advantage=GRPO)
    by_id = dict(zip(rewards.column("sample_id").to_pylist(), rewards.column("reward").to_pylist()))
    assert by_id["0-0-0_0_0"] == 0.75 and by_id["0-0-0_1_0"] == 0.25  # episode 0: solver 1, verifier 0
    assert by_id["0-0-0_0_1"] == 0.25 and by_id["0-0-0_1_1"] == 0.75  # episode 1: solver 0, verifier 1


def test_advantages_are_relative_to_the_stored_group_by_hand() -> None:
    env = MathSolverVerifier(MathOptions())
    task = {"id": "q", "question": "2+3?", "answer": 5}
    # Every sample_id says one group (0-0-0_<turn>_<e>); the group_id column says two, interleaved: A = episodes
    # 0, 2, 4 and B = 1, 3. Own rewards: "5", "wrong", "5" -> solver 1, verifier 0; "4", "wrong", "4" -> 0, 1.
    right, wrong = ["5", "wrong", "5"], ["4", "wrong", "4"]
    rollouts = rollouts_of(env, task, [right, right, wrong, wrong, wrong], groups=["A", "B", "A", "B", "A"])
    rewards = score_micro_batch(env, rollouts, execute_micro_batch(env, rollouts), advantage=GRPO, team_weight=0.0)
    advantage = {(row["episode"], row["agent"]): row["advantage"] for row in rewards.to_pylist()}
    # A: solver rewards 1, 0, 0 (mean 1/3, std sqrt(2)/3) -> sqrt(2), -1/sqrt(2), -1/sqrt(2); verifier the negation.
    # B: solver 1, 0 (mean 1/2, std 1/2) -> 1, -1. One group of all five would give the solver of episode 0 1.22.
    root2 = 2 ** 0.5
    expected = {0: root2, 2: -1 / root2, 4: -1 / root2, 1: 1.0, 3: -1.0}
    for episode, value in expected.items():
        assert advantage[episode, "solver"] == pytest.approx(value, abs=1e-6)
        assert advantage[episode, "verifier"] == pytest.approx(-value, abs=1e-6)
    assert rewards.column("group_id").to_pylist() == rollouts.column("group_id").to_pylist()
    # A table without groups is refused, not scored as one group.
    ungrouped = rollouts.set_column(rollouts.column_names.index("group_id"), "group_id",
                                    pa.nulls(rollouts.num_rows, pa.string()))
    with pytest.raises(ValueError, match="15 rollout turns have no group_id"):
        score_micro_batch(env, ungrouped, execute_micro_batch(env, rollouts), advantage=GRPO)


class _TurnScored(MathSolverVerifier):
    """The solver's two turns each scored on their own: its first answer's grade, then its revision's."""

    def score_turns(self, task, transcript, results):
        if transcript[0].text == "unscored":
            return None  # this episode falls back to the per-agent reward
        return [float(results[0].success), float(results[1].success), float(results[2].success)]


def test_turn_level_rewards_and_advantages_by_hand() -> None:
    env = _TurnScored(MathOptions())
    task = {"id": "q", "question": "2+3?", "answer": 5}
    # first answer right/wrong, revision right/wrong; per-agent score: the solver's final answer, the verifier's verdict
    rollouts = rollouts_of(env, task, [["5", "correct", "4"], ["4", "wrong", "5"], ["4", "wrong", "4"]])
    rewards = score_micro_batch(env, rollouts, execute_micro_batch(env, rollouts), advantage=GRPO, team_weight=0.0)
    by_turn = {(row["episode"], row["turn"]): (row["reward"], row["advantage"]) for row in rewards.to_pylist()}
    # turn 0 rewards 1, 0, 0 (mean 1/3, std sqrt(2)/3); turn 2 rewards 0, 1, 0: each against its own turn's group
    root2 = 2 ** 0.5
    for (episode, turn), (reward, advantage) in {(0, 0): (1.0, root2), (1, 0): (0.0, -1 / root2),
                                                  (2, 0): (0.0, -1 / root2), (0, 2): (0.0, -1 / root2),
                                                  (1, 2): (1.0, root2), (2, 2): (0.0, -1 / root2)}.items():
        assert by_turn[episode, turn] == pytest.approx((reward, advantage), abs=1e-6), (episode, turn)
    # the verifier's turn: its verdicts right, right, right -> reward 1 each, advantage 0
    assert [by_turn[e, 1] for e in range(3)] == [(1.0, 0.0)] * 3
    # team credit mixes the team mean of score() into each turn: episode 0's score is solver 0, verifier 1
    mixed = score_micro_batch(env, rollouts, execute_micro_batch(env, rollouts), advantage=GRPO, team_weight=0.5)
    assert mixed.sort_by([("episode", "ascending"), ("turn", "ascending")]).column("reward").to_pylist()[:3] == [
        0.75, 0.75, 0.25]
    # None: that episode's turns get the per-agent reward
    fallback = rollouts_of(env, task, [["unscored", "wrong", "5"]])
    assert score_micro_batch(env, fallback, execute_micro_batch(env, fallback), advantage=GRPO).column(
        "reward").to_pylist() == [1.0, 1.0, 1.0]
    # a wrong length is a clear error
    class _Short(MathSolverVerifier):
        def score_turns(self, task, transcript, results):
            return [1.0]

    short = _Short(MathOptions())
    with pytest.raises(ValueError, match="one reward per turn \\(3\\)"):
        score_micro_batch(short, rollouts, execute_micro_batch(short, rollouts), advantage=GRPO)


class _Weighted(_TurnScored):
    """The same turn rewards, the revision's advantages weighted by 0.25 and the verdict's by 0."""

    weights: object = (1.0, 0.0, 0.25)

    def turn_weights(self, task, transcript):
        return list(self.weights) if self.weights is not None else None


def test_turn_weights_scale_each_turns_advantage_after_its_group_normalisation() -> None:
    env = _Weighted(MathOptions())
    task = {"id": "q", "question": "2+3?", "answer": 5}
    rollouts = rollouts_of(env, task, [["5", "correct", "4"], ["4", "correct", "5"], ["4", "correct", "4"]])

    def scored() -> dict:
        rewards = score_micro_batch(env, rollouts, execute_micro_batch(env, rollouts), advantage=GRPO, team_weight=0.0)
        return {(row["episode"], row["turn"]): (row["reward"], row["advantage"]) for row in rewards.to_pylist()}

    by_turn = scored()
    root2 = 2 ** 0.5
    # turn 0 as unweighted (rewards 1, 0, 0); turn 2's rewards 0, 1, 0 give -1/sqrt2, sqrt2, -1/sqrt2, times 0.25;
    # turn 1's verdicts ("correct" to 5, 4, 4: rewards 1, 0, 0) have advantages, times 0; rewards stay unweighted
    for (episode, turn), (reward, advantage) in {(0, 0): (1.0, root2), (1, 0): (0.0, -1 / root2),
                                                  (0, 1): (1.0, 0.0), (1, 1): (0.0, 0.0),
                                                  (0, 2): (0.0, -0.25 / root2), (1, 2): (1.0, 0.25 * root2),
                                                  (2, 2): (0.0, -0.25 / root2)}.items():
        assert by_turn[episode, turn] == pytest.approx((reward, advantage), abs=1e-6), (episode, turn)
    for bad, message in [((1.0, 1.0), "one weight per turn \\(3\\)"), ((1.0, -1.0, 1.0), "negative or not finite"),
                         ((1.0, float("nan"), 1.0), "negative or not finite")]:
        env.weights = bad
        with pytest.raises(ValueError, match=message):
            score_micro_batch(env, rollouts, execute_micro_batch(env, rollouts), advantage=GRPO)
    env.weights = None  # None: every turn weighs 1
    assert [scored()[0, turn][1] for turn in range(3)] == pytest.approx([root2, root2, -1 / root2], abs=1e-6)


def test_a_version_4_partition_is_re_scored_with_the_same_groups(small_config) -> None:
    from marl_pipeline.environment import build_environment
    from marl_pipeline.stages.recompute import recompute_stage
    from marl_pipeline.store import ExperienceStore, MicroBatchKey
    from tests.test_store import as_version_4

    env = build_environment(small_config.environment.name, small_config.environment.options)
    store, key = ExperienceStore(small_config.store), MicroBatchKey(small_config.run, 0, 0)
    # Two prompts of the same task (so task_id is no group), three episodes each, as the rollout stage names them.
    task = {"id": "1+1", "a": 1, "b": 1}
    answers = {0: ["2", "2", "3"], 1: ["3", "3", "2"]}
    rows = []
    for prompt, texts in answers.items():
        for t, text in enumerate(texts):
            for turn, (role, reply) in enumerate(zip(env.turn_order, [text, "yes"])):
                rows.append({"sample_id": f"0-0-{prompt}_{turn}_{t}", "episode": 3 * prompt + t, "task_id": task["id"],
                             "group_id": f"0-0-{prompt}", "trajectory": t, "role": role, "turn": turn,
                             "task": json.dumps(task), "policy_version": 0, "engine": "x", "prompt_text": "",
                             "response_text": reply, "prompt_ids": [], "response_ids": [], "logprobs": [],
                             "finish_reason": "stop", "status": "ok", "error": None, "agent": role})
    store.commit("rollouts", key, pa.Table.from_pylist(rows, schema=with_agent(ROLLOUTS)))
    recompute_stage("environment_results", small_config, store, key)
    _, scored, _ = recompute_stage("rewards", small_config, store, key)
    before = {row["sample_id"]: row for row in scored.to_pylist()}
    # Per prompt, the solver (and the verifier, who says yes) gets 1, 1, 0 and 0, 0, 1: +-1/sqrt(2) and -+sqrt(2).
    # One group of the micro-batch (or of the task) would give +-1.
    root2 = 2 ** 0.5
    assert [before[f"0-0-0_0_{t}"]["advantage"] for t in range(3)] == pytest.approx(
        [1 / root2, 1 / root2, -root2], abs=1e-5)  # eps in the std
    assert [before[f"0-0-1_1_{t}"]["advantage"] for t in range(3)] == pytest.approx(
        [-1 / root2, -1 / root2, root2], abs=1e-5)
    for stage in ("rollouts", "environment_results", "rewards"):
        as_version_4(store, stage, key)
    # Re-executed and re-scored from the old partitions: the same groups, so the same advantages, now stored.
    recompute_stage("environment_results", small_config, store, key)
    _, rescored, _ = recompute_stage("rewards", small_config, store, key)
    for row in rescored.to_pylist():
        assert (row["group_id"], row["reward"], row["advantage"]) == tuple(
            before[row["sample_id"]][name] for name in ("group_id", "reward", "advantage"))
    assert store.manifest("rewards", key).schema_version == SCHEMA_VERSION
    assert store.dataset(key.run, "rewards").to_table(columns=["group_id"]).column("group_id").null_count == 0


def test_task_files(tmp_path) -> None:
    import pyarrow.parquet as pq

    (tmp_path / "t.jsonl").write_text('{"question": "1+1?", "answer": 2}\n{"question": "2+2?", "answer": "4"}\n')
    pq.write_table(pa.table({"question": ["3+3?"], "answer": [6]}), tmp_path / "t.parquet")
    for name, count in (("t.jsonl", 2), ("t.parquet", 1)):
        env = MathSolverVerifier(MathOptions(task_file=str(tmp_path / name)))
        assert {t["answer"] for t in env.sample_tasks(__import__("numpy").random.default_rng(0), 20)} <= {2, 4, 6}
        assert len(env._file_tasks) == count
    (tmp_path / "bad.jsonl").write_text('{"question": "1+1?"}\n')
    with pytest.raises(ValueError, match=r"row 1: missing \['answer'\]"):
        MathOptions(task_file=str(tmp_path / "bad.jsonl"))
