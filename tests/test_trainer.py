"""The trainer: gradient accumulation over micro-batches equals one full-batch step."""

from __future__ import annotations

from itertools import pairwise
from pathlib import Path

import numpy as np
import pytest
import torch

from marl_pipeline.training.batches import TrainBatch, length_chunks
from marl_pipeline.training.trainer import PolicyTrainer


def _random_batch(rng: np.random.Generator, rows: int, vocab: int) -> TrainBatch:
    prompts = [rng.integers(1, vocab, size=rng.integers(2, 6)).tolist() for _ in range(rows)]
    responses = [rng.integers(1, vocab, size=rng.integers(1, 5)).tolist() for _ in range(rows)]
    old = [(-rng.random(len(r)) * 3).tolist() for r in responses]
    return TrainBatch(prompts, responses, old, rng.normal(size=rows).tolist())


def _split(batch: TrainBatch, bounds: list[int]) -> list[TrainBatch]:
    parts = []
    for start, end in pairwise(bounds):
        parts.append(TrainBatch(batch.prompt_ids[start:end], batch.response_ids[start:end],
                                batch.old_logprobs[start:end], batch.advantages[start:end]))
    return parts


def _trainer(model_dir: Path, **options) -> PolicyTrainer:
    return PolicyTrainer(str(model_dir), 0, lr=1e-2, weight_decay=0.01, max_grad_norm=1.0, clip_eps=0.2, seed=0,
                         num_threads=1, **options)


ALGORITHM_OPTIONS = {
    "token": dict(loss_normalization="token"),
    "sequence": dict(loss_normalization="sequence"),
    "sequence+kl+entropy+tis": dict(loss_normalization="sequence", kl_coef=0.1, entropy_coef=0.01, tis_cap=2.0),
    "token+kl+entropy+tis": dict(loss_normalization="token", kl_coef=0.1, entropy_coef=0.01, tis_cap=2.0),
}


@pytest.mark.parametrize("options", ALGORITHM_OPTIONS.values(), ids=ALGORITHM_OPTIONS)
def test_gradient_accumulation_equals_full_batch_update(tiny_model_dir: Path, options: dict) -> None:
    vocab = 200
    batch = _random_batch(np.random.default_rng(0), rows=12, vocab=vocab)
    if options.get("kl_coef"):
        options = {**options, "reference_dir": str(tiny_model_dir)}
    full, accumulated = _trainer(tiny_model_dir, **options), _trainer(tiny_model_dir, **options)
    # In float64: the claim is that the two updates are the same function of the data. In float32 they differ
    # by summation order (~1e-7), which AdamW's first steps (g / sqrt(g^2)) blow up for near-zero gradients.
    for trainer in (full, accumulated):
        trainer.model.double()  # in place: the optimizer keeps the same parameter objects
        if trainer.reference is not None:
            trainer.reference.double()
    for _ in range(2):  # two optimizer steps, so AdamW's moment estimates are compared too
        full.accumulate(batch)
        full_stats = full.apply_step()
        # uneven micro-batches: a mean-per-micro-batch loss would weight them differently
        for part in _split(batch, [0, 2, 7, 12]):
            accumulated.accumulate(part)
        accumulated_stats = accumulated.apply_step()
        assert (accumulated_stats.tokens, accumulated_stats.sequences) == (full_stats.tokens, full_stats.sequences)
        assert full_stats.sequences == 12
    assert full.version == accumulated.version == 2
    worst = max((a - b).abs().max().item() for a, b in zip(full.model.parameters(), accumulated.model.parameters()))
    assert worst <= 1e-5
    moved = max((a - b).abs().max().item() for a, b in
                zip(full.model.parameters(), _trainer(tiny_model_dir).model.parameters()))
    assert moved > 1e-3  # the step did change the parameters


def test_positive_advantage_raises_the_sampled_tokens_probability(tiny_model_dir: Path) -> None:
    trainer = _trainer(tiny_model_dir)
    prompt, response = [5, 6, 7], [8, 9]
    before = trainer.completion_logprobs(prompt, response)
    trainer.accumulate(TrainBatch([prompt], [response], [before], [1.0]))
    trainer.apply_step()
    after = trainer.completion_logprobs(prompt, response)
    assert sum(after) > sum(before)
    assert torch.get_num_threads() >= 1


def test_a_step_without_rows_advances_the_version_and_leaves_the_weights(tiny_model_dir: Path) -> None:
    """An agent with no turn in a step (a game that ended before its seat moved) still publishes that step's version,
    the weights unchanged; then the next step trains as usual."""
    trainer = _trainer(tiny_model_dir)
    before = [param.detach().clone() for param in trainer.model.parameters()]
    stats = trainer.apply_step()
    assert (stats.policy_version, stats.tokens, stats.sequences) == (1, 0, 0) and trainer.version == 1
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))
    trainer.accumulate(TrainBatch([[5, 6, 7]], [[8, 9]], [[-1.0, -1.0]], [1.0]))
    assert trainer.apply_step().policy_version == 2
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))


def test_a_learning_rate_of_0_keeps_version_0s_weights(tiny_model_dir: Path) -> None:
    trainer = PolicyTrainer(str(tiny_model_dir), 0, lr=0.0, weight_decay=0.01, max_grad_norm=1.0, clip_eps=0.2, seed=0,
                            num_threads=1)
    before = [param.detach().clone() for param in trainer.model.parameters()]
    trainer.accumulate(TrainBatch([[5, 6, 7]], [[8, 9]], [[-1.0, -1.0]], [1.0]))
    assert trainer.apply_step().grad_norm > 0  # it computed the step ...
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))  # ... and moved nothing


def test_length_chunks_sort_rows_and_keep_each_pass_within_the_budget() -> None:
    lengths = [9, 3, 30, 4, 9, 5, 3]
    chunks = length_chunks(lengths, budget=12)
    assert sorted(row for chunk in chunks for row in chunk) == list(range(len(lengths)))  # every row, once
    order = [row for chunk in chunks for row in chunk]
    assert [lengths[row] for row in order] == sorted(lengths)
    assert order[:2] == [1, 6]  # equal lengths keep their order
    assert chunks[-1] == [2]  # longer than the budget: a pass of its own
    assert all(len(chunk) * max(lengths[row] for row in chunk) <= 12 for chunk in chunks[:-1])
    assert chunks == [[1, 6, 3], [5], [0], [4], [2]]


@pytest.mark.parametrize("options", [ALGORITHM_OPTIONS["token"], ALGORITHM_OPTIONS["sequence+kl+entropy+tis"]],
                         ids=["token", "sequence+kl+entropy+tis"])
def test_passes_under_a_token_budget_give_the_one_pass_update(tiny_model_dir: Path, options: dict) -> None:
    batch = _random_batch(np.random.default_rng(1), rows=12, vocab=200)
    if options.get("kl_coef"):
        options = {**options, "reference_dir": str(tiny_model_dir)}
    one_pass = _trainer(tiny_model_dir, chunk_tokens=10_000, **options)
    chunked = _trainer(tiny_model_dir, chunk_tokens=12, **options)
    lengths = [len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids)]
    assert len(length_chunks(lengths, 12)) >= 4  # the budget does cut the micro-batch
    for trainer in (one_pass, chunked):  # float64, as above: the claim is about the function, not rounding
        trainer.model.double()
        if trainer.reference is not None:
            trainer.reference.double()
    for _ in range(2):
        one_stats, chunked_stats = one_pass.accumulate(batch), chunked.accumulate(batch)
        assert chunked_stats.pop("compute_seconds") > 0 and one_stats.pop("compute_seconds") > 0  # timed
        assert chunked_stats == pytest.approx(one_stats, rel=1e-6, abs=1e-9)  # the statistics of the whole batch
        one_pass.apply_step()
        chunked.apply_step()
    worst = max((a - b).abs().max().item() for a, b in zip(one_pass.model.parameters(), chunked.model.parameters()))
    assert worst <= 1e-5
    moved = max((a - b).abs().max().item() for a, b in
                zip(one_pass.model.parameters(), _trainer(tiny_model_dir).model.parameters()))
    assert moved > 1e-3


def test_a_token_budget_below_one_is_refused(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="chunk_tokens 0: expected a positive token budget"):
        _trainer(tiny_model_dir, chunk_tokens=0)


def test_activation_checkpointing_gives_the_same_gradient(tiny_model_dir: Path) -> None:
    batch = _random_batch(np.random.default_rng(3), rows=8, vocab=200)
    plain, recomputed = _trainer(tiny_model_dir), _trainer(tiny_model_dir, activation_checkpointing=True)
    assert recomputed.model.is_gradient_checkpointing and not plain.model.is_gradient_checkpointing
    for trainer in (plain, recomputed):
        trainer.accumulate(batch)
    for a, b in zip(plain.model.parameters(), recomputed.model.parameters()):
        assert torch.allclose(a.grad, b.grad, rtol=0, atol=1e-6)
