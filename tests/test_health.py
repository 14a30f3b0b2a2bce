"""Training-health signals by hand (stages/health.py): a step's rows in, each agent's figures out."""

from __future__ import annotations

import pytest

from marl_pipeline.stages.health import health_table


def _turn(agent: str, group: str, text: str, logprobs: list[float], finish: str = "stop", turn: int = 0) -> dict:
    return {"agent": agent, "group_id": group, "turn": turn, "response_text": text,
            "response_ids": list(range(len(logprobs))), "logprobs": logprobs, "finish_reason": finish}


def test_signals_by_hand() -> None:
    rollouts = [
        # solver, prompt g1: "4" twice and "5" once; prompt g2: "7" twice (one cut at the token limit)
        _turn("solver", "g1", "4", [-1.0]), _turn("solver", "g1", "4", [-1.0]),
        _turn("solver", "g1", "5", [-2.0, -2.0]),
        _turn("solver", "g2", "7", [-0.5]), _turn("solver", "g2", "7", [-0.5], finish="length"),
        # verifier: "yes" to everything
        _turn("verifier", "g1", "yes", [-0.1]), _turn("verifier", "g1", "yes", [-0.1]),
    ]
    rewards = [{"agent": "solver", "group_id": "g1", "reward": r} for r in (1.0, 1.0, 0.0)]
    rewards += [{"agent": "solver", "group_id": "g2", "reward": r} for r in (1.0, 1.0)]
    rewards += [{"agent": "verifier", "group_id": "g1", "reward": r} for r in (0.5, 0.5)]
    updates = [{"agent": "solver", "tokens": 4, "loss_sum": 2.0, "clip_fraction": 0.5, "mismatch_abs_logprob": 0.1},
               {"agent": "solver", "tokens": 2, "loss_sum": 1.0, "clip_fraction": 0.0, "mismatch_abs_logprob": 0.4}]
    table = health_table(rollouts, rewards, updates, {"solver": 3, "verifier": 3}, {"solver": 2.5})
    solver, verifier = table.to_pylist()
    assert solver["agent"] == "solver" and solver["policy_version"] == 3 and solver["groups"] == 2
    assert solver["zero_variance_groups"] == 0.5  # g2's rewards are all 1
    assert solver["distinct_responses"] == pytest.approx((2 / 3 + 1 / 2) / 2)
    assert solver["top_response_share"] == pytest.approx((2 / 3 + 1) / 2)
    assert solver["token_entropy"] == pytest.approx((1 + 1 + 4 + 0.5 + 0.5) / 6)
    assert solver["response_length"] == pytest.approx(6 / 5)
    assert solver["truncated_share"] == pytest.approx(1 / 5)
    assert solver["loss_per_token"] == pytest.approx(3 / 6)
    assert solver["clip_fraction"] == pytest.approx((0.5 * 4) / 6)
    assert solver["mismatch_abs_logprob"] == pytest.approx((0.1 * 4 + 0.4 * 2) / 6)
    assert solver["grad_norm"] == 2.5
    # The verifier collapsed on "yes": one answer per prompt, no reward variance; it did not train this step.
    assert verifier["top_response_share"] == 1.0 and verifier["distinct_responses"] == 0.5
    assert verifier["zero_variance_groups"] == 1.0
    assert verifier["loss_per_token"] is None and verifier["clip_fraction"] is None and verifier["grad_norm"] is None
