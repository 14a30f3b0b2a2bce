"""Pure math: the clipped policy-gradient loss and its statistics, against hand-derived values."""

from __future__ import annotations

import math

import pytest
import torch

from marl_pipeline.training.losses import (
    clip_fraction,
    clipped_pg_token_loss,
    mismatch_stats,
    pad_sequences,
    summed_loss,
)


def test_clipped_loss_matches_hand_computation() -> None:
    # Two sequences, two tokens each; the second token of row 0 is padding.
    logprobs = torch.tensor([[math.log(0.5), 0.0], [math.log(0.9), math.log(0.2)]])
    old = torch.tensor([[math.log(0.25), 0.0], [math.log(0.9), math.log(0.4)]])
    advantages = torch.tensor([1.0, -2.0])
    mask = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    token_loss, ratio = clipped_pg_token_loss(logprobs, old, advantages, clip_eps=0.2)
    loss = summed_loss(token_loss, mask, "token")
    # row 0: ratio 2.0, A=+1 -> max(-2.0, -1.2) = -1.2
    # row 1 tok 0: ratio 1.0, A=-2 -> 2.0 ; tok 1: ratio 0.5, A=-2 -> max(1.0, 1.6) = 1.6
    assert loss.item() == pytest.approx(-1.2 + 2.0 + 1.6, abs=1e-6)
    assert clip_fraction(ratio, mask, clip_eps=0.2) == pytest.approx(2 / 3)
    assert mismatch_stats(logprobs, old, mask)["mean_ratio"] == pytest.approx((2.0 + 1.0 + 0.5) / 3, abs=1e-6)


def test_loss_gradient_is_zero_outside_the_clip_region_in_the_favoured_direction() -> None:
    logprobs = torch.tensor([[math.log(0.6)]], requires_grad=True)
    old = torch.tensor([[math.log(0.3)]])  # ratio 2 > 1.2 with A > 0: clipped, no gradient
    token_loss, _ = clipped_pg_token_loss(logprobs, old, torch.tensor([1.0]), clip_eps=0.2)
    summed_loss(token_loss, torch.ones(1, 1), "token").backward()
    assert logprobs.grad.item() == 0.0


def test_response_mask_aligns_with_next_token_logits() -> None:
    input_ids, attention, mask = pad_sequences([[5, 6, 7]], [[8, 9]], pad_id=0)
    assert input_ids.tolist() == [[5, 6, 7, 8, 9]]
    # logits at positions 2 and 3 predict tokens 8 and 9
    assert mask.tolist() == [[0.0, 0.0, 1.0, 1.0]]
    assert attention.tolist() == [[1, 1, 1, 1, 1]]
