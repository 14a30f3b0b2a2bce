"""Advantage estimators by hand (stages/advantages/), chosen by ``algorithm.advantage.type`` in the config, and the
reward stage using the configured one."""

from __future__ import annotations

import math

import numpy as np
import pytest
from pydantic import ValidationError

from environments.math_verifier import MathOptions, MathSolverVerifier
from marl_pipeline.config import (
    AgentNormalizedAdvantage,
    AlgorithmConfig,
    DrGRPOAdvantage,
    GRPOAdvantage,
    RLOOAdvantage,
)
from marl_pipeline.stages.advantages import ESTIMATORS, ScoredRows, estimator
from marl_pipeline.stages.execution import execute_micro_batch
from marl_pipeline.stages.reward import score_micro_batch
from tests.test_credit_and_actions import rollouts_of

# Group a: rewards 1, 0, 0, 0 (mean 0.25, population std sqrt(0.1875)); group b: 1, 1 (all equal); group c: 3 alone.
# One row per episode.
ROWS = ScoredRows(np.array([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 3.0]), np.array(["a", "a", "a", "a", "b", "b", "c"]),
                  np.array(["solver"] * 7), np.arange(7))


def test_grpo_by_hand() -> None:
    std = math.sqrt(0.1875)
    expected = [0.75 / std, -0.25 / std, -0.25 / std, -0.25 / std, 0.0, 0.0, 0.0]
    assert estimator(GRPOAdvantage(eps=1e-6))(ROWS) == pytest.approx(expected, rel=1e-5)


def test_dr_grpo_by_hand() -> None:
    # no division by the group's std: the group-a advantages keep the rewards' scale
    expected = [0.75, -0.25, -0.25, -0.25, 0.0, 0.0, 0.0]
    assert estimator(DrGRPOAdvantage())(ROWS) == pytest.approx(expected, abs=1e-12)


def test_rloo_by_hand() -> None:
    # against the mean of the others: 1 - 0 = 1; 0 - 1/3 for each zero; b: 1 - 1 = 0; c has no others -> 0
    expected = [1.0, -1 / 3, -1 / 3, -1 / 3, 0.0, 0.0, 0.0]
    assert estimator(RLOOAdvantage())(ROWS) == pytest.approx(expected, abs=1e-12)
    # An agent with two turns per episode (rewards 1, 1 | 0, 0 | 0, 0): its own other turn is not a baseline.
    twice = ScoredRows(np.array([1.0, 1.0, 0.0, 0.0, 0.0, 0.0]), np.zeros(6), np.array(["solver"] * 6),
                       np.array([0, 0, 1, 1, 2, 2]))
    assert estimator(RLOOAdvantage())(twice) == pytest.approx([1.0, 1.0, -0.5, -0.5, -0.5, -0.5], abs=1e-12)


def test_agent_normalized_by_hand() -> None:
    # Two agents in the same two groups. Solver: group g 1, 0 (centred 0.5, -0.5), group h 1, 1 (0, 0): its
    # centred rewards 0.5, -0.5, 0, 0 have std sqrt(0.125). Verifier: g 4, 0 (2, -2), h 0, 2 (-1, 1): std
    # sqrt(2.5). GRPO would give both agents +-1 in every varied group; here each keeps its own scale.
    rewards = np.array([1.0, 0.0, 1.0, 1.0, 4.0, 0.0, 0.0, 2.0])
    groups = np.array(["g/solver", "g/solver", "h/solver", "h/solver", "g/verifier", "g/verifier", "h/verifier",
                       "h/verifier"])
    agents = np.array(["solver"] * 4 + ["verifier"] * 4)
    solver, verifier = math.sqrt(0.125), math.sqrt(2.5)
    expected = [0.5 / solver, -0.5 / solver, 0.0, 0.0, 2 / verifier, -2 / verifier, -1 / verifier, 1 / verifier]
    rows = ScoredRows(rewards, groups, agents, np.array([0, 1, 2, 3, 0, 1, 2, 3]))
    assert estimator(AgentNormalizedAdvantage(eps=1e-9))(rows) == pytest.approx(expected, rel=1e-6)
    assert estimator(GRPOAdvantage(eps=1e-9))(rows) == pytest.approx(
        [1, -1, 0, 0, 1, -1, -1, 1], abs=1e-6)


def test_every_estimator_is_zero_mean_per_group_and_leaves_uninformative_groups_at_zero() -> None:
    rng = np.random.default_rng(0)
    rewards = rng.normal(size=40)
    rewards[32:] = 0.5  # a group whose episodes all earned the same
    rows = ScoredRows(rewards, np.repeat(np.arange(5), 8), np.repeat(["solver", "verifier"], [16, 24]), np.arange(40))
    for kind in ESTIMATORS:
        settings = AlgorithmConfig.model_validate({"advantage": {"type": kind}}).advantage
        values = estimator(settings)(rows)
        assert values.shape == rewards.shape and np.isfinite(values).all(), kind
        assert np.abs(values.reshape(5, 8).mean(axis=1)).max() < 1e-9, kind
        assert np.abs(values[32:]).max() == 0.0, kind


def test_the_config_chooses_the_estimator_and_names_what_is_wrong() -> None:
    assert AlgorithmConfig().advantage == GRPOAdvantage()
    assert AlgorithmConfig.model_validate({"advantage": {"type": "rloo"}}).advantage == RLOOAdvantage()
    with pytest.raises(ValidationError, match="ppo"):
        AlgorithmConfig.model_validate({"advantage": {"type": "ppo"}})
    with pytest.raises(ValidationError, match="eps"):
        AlgorithmConfig.model_validate({"advantage": {"type": "rloo", "eps": 0.1}})  # rloo divides by nothing
    with pytest.raises(ValidationError, match=r"advantage_eps is now algorithm\.advantage\.eps"):
        AlgorithmConfig.model_validate({"advantage_eps": 1e-6})


def test_the_reward_stage_uses_the_configured_estimator() -> None:
    env = MathSolverVerifier(MathOptions())
    task = {"id": "q", "question": "2+3?", "answer": 5}
    # solver's final answers 5, 4, 4 -> its rewards 1, 0, 0 in one group
    rollouts = rollouts_of(env, task, [["5", "correct", "5"], ["4", "wrong", "4"], ["4", "wrong", "4"]])
    results = execute_micro_batch(env, rollouts)
    rows = {kind: [row for row in score_micro_batch(env, rollouts, results, advantage=settings, team_weight=0.0)
                   .sort_by([("episode", "ascending"), ("turn", "ascending")]).to_pylist() if row["turn"] == 2]
            for kind, settings in {"rloo": RLOOAdvantage(), "dr_grpo": DrGRPOAdvantage()}.items()}
    assert [row["reward"] for row in rows["rloo"]] == [1.0, 0.0, 0.0]
    assert [row["advantage"] for row in rows["rloo"]] == pytest.approx([1.0, -0.5, -0.5])
    assert [row["advantage"] for row in rows["dr_grpo"]] == pytest.approx([2 / 3, -1 / 3, -1 / 3])
