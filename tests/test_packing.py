"""Packed passes (training/packing.py): rows concatenated into one sequence, positions restarting, attention per row,
give the padded passes' update. On a CPU the per-row attention is SDPA row by row (what varlen attention computes on
a GPU: tests/gpu holds that one); everything else, the packing, positions, spans, losses and gradients, is the
trainer's own code."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from marl_pipeline.training import packing
from marl_pipeline.training.batches import TrainBatch
from marl_pipeline.training.trainer import PolicyTrainer
from tests.test_trainer import ALGORITHM_OPTIONS, _random_batch


def _trainer(model_dir: Path, packed: bool, **options) -> PolicyTrainer:
    trainer = PolicyTrainer(str(model_dir), 0, lr=1e-2, weight_decay=0.01, max_grad_norm=1.0, clip_eps=0.2, seed=0,
                            num_threads=1, **options)
    assert trainer.passes.padded_why.startswith("padded: varlen attention runs on CUDA")  # a CPU trainer pads
    if packed:  # what packing.choose does on a GPU, with the per-row SDPA standing in for varlen attention
        trainer.passes.padded_why = None
        for model in (trainer.model, trainer.reference):
            if model is not None:
                packing.use_varlen(model)
    for model in (trainer.model, trainer.reference):  # float64: the claim is the function, not its rounding
        if model is not None:
            model.double()
    return trainer


@pytest.mark.parametrize("options", [ALGORITHM_OPTIONS["token"], ALGORITHM_OPTIONS["sequence+kl+entropy+tis"]],
                         ids=["token", "sequence+kl+entropy+tis"])
def test_a_packed_pass_gives_the_padded_passes_log_probabilities_and_gradients(tiny_model_dir: Path,
                                                                               options: dict) -> None:
    batch = _random_batch(np.random.default_rng(3), rows=10, vocab=200)
    if options.get("kl_coef"):
        options = {**options, "reference_dir": str(tiny_model_dir)}
    padded, packed = (_trainer(tiny_model_dir, flag, chunk_tokens=24, **options) for flag in (False, True))
    lengths = [len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids)]
    assert len(packing.packed_chunks(lengths, 24)) >= 3  # several packed passes, each of several rows
    for _ in range(2):
        stats = [trainer.accumulate(batch) for trainer in (padded, packed)]
        for figures in stats:
            assert figures.pop("compute_seconds") > 0
        # float32 figures (the terms leave the head in float32), summed in another order: 1e-7 apart
        assert stats[1] == pytest.approx(stats[0], rel=1e-6, abs=1e-9)  # loss, ratios and mismatch of every token
        for a, b in zip(padded.model.parameters(), packed.model.parameters()):
            assert torch.allclose(a.grad, b.grad, rtol=1e-9, atol=1e-12)
        results = [trainer.apply_step() for trainer in (padded, packed)]
        assert results[0].tokens == results[1].tokens and results[0].sequences == results[1].sequences
        assert (results[0].passes, results[1].passes) == ("padded", "packed")
        assert results[1].computed_tokens == sum(lengths)  # real tokens only; the padded passes' count is the same
    for prompt, response in zip(batch.prompt_ids[:3], batch.response_ids[:3]):
        assert padded.completion_logprobs(prompt, response) == pytest.approx(
            packed.completion_logprobs(prompt, response), rel=1e-9)  # the packed model's unpacked calls: SDPA
    worst = max((a - b).abs().max().item() for a, b in zip(padded.model.parameters(), packed.model.parameters()))
    assert worst <= 1e-9


def test_a_packed_pass_computes_no_attention_across_rows(tiny_model_dir: Path) -> None:
    """Row 2's log-probabilities are the same whatever row precedes it in the packed sequence."""
    trainer = _trainer(tiny_model_dir, True)
    rows = ([5, 6, 7], [8, 9, 10]), ([11, 12], [13, 14, 15, 16])
    scores = []
    for first in ([20, 21, 22, 23, 24], [30]):
        built = packing.packed_pass([first, rows[1][0]], [[40, 41], rows[1][1]])
        taken = built.mask.bool()
        with torch.no_grad():
            terms = trainer._terms(built.input_ids, None, taken, packing=built.packing)
        scores.append(terms.logprobs[-len(rows[1][1]):])
    assert torch.allclose(scores[0], scores[1], rtol=1e-12)


def test_packed_pass_layout_positions_spans_and_chunks() -> None:
    built = packing.packed_pass([[1, 2], [3]], [[4, 5, 6], [7, 8]])
    assert built.input_ids.tolist() == [[1, 2, 4, 5, 6, 3, 7, 8]]
    assert built.packing["position_ids"].tolist() == [[0, 1, 2, 3, 4, 0, 1, 2]]
    assert built.packing["cu_seq_lens_q"].tolist() == [0, 5, 8] and built.packing["max_length_q"] == 5
    # position t predicts token t + 1: row 1's response from position 1, row 2's from 5; position 4 (row 1's last
    # token, followed by row 2's first) predicts nothing
    assert built.mask.tolist() == [[0, 1, 1, 1, 0, 1, 1]]
    assert built.spans == [(1, 3), (5, 2)] and built.tokens == 8 and built.counts() == (5, 2)
    assert built.spread([0.5, -1.0]).tolist() == [[0, 0.5, 0.5, 0.5, 0, -1, -1]]
    assert built.spread([[-1, -2, -3], [-4, -5]]).tolist() == [[0, -1, -2, -3, 0, -4, -5]]
    assert built.loss_weights("sequence").tolist()[0] == pytest.approx([0, 1 / 3, 1 / 3, 1 / 3, 0, 0.5, 0.5])
    padded = packing.padded_pass([[1, 2], [3]], [[4, 5, 6], [7, 8]], pad_id=0)
    assert padded.spans == [(1, 3), (4 + 0, 2)] and padded.tokens == 8
    assert padded.spread([0.5, -1.0]).tolist() == [[0, 0.5, 0.5, 0.5], [-1, -1, 0, 0]]
    assert packing.packed_chunks([5, 4, 9, 3, 1], budget=9) == [[0, 1], [2], [3, 4]]
    assert packing.packed_chunks([12, 2], budget=9) == [[0], [1]]  # a row over the budget: a pass of its own
    with pytest.raises(ValueError, match="empty prompt"):
        packing.packed_pass([[]], [[1]])


def test_a_cpu_trainer_pads_and_says_why_and_keeps_its_default_budget(tiny_model_dir: Path) -> None:
    trainer = PolicyTrainer(str(tiny_model_dir), 0, lr=1e-2, weight_decay=0.0, max_grad_norm=1.0, clip_eps=0.2,
                            seed=0, num_threads=1)
    trainer.accumulate(TrainBatch([[5, 6]], [[7, 8]], [[-1.0, -1.0]], [1.0]))
    settings = trainer.pass_settings()
    assert settings["passes"] == "padded" and "CUDA" in settings["padded_why"]
    assert settings["chunk_tokens"] == 2048 and settings["budget_why"] == "the CPU's default"
    result = trainer.apply_step()
    assert result.chunk_tokens == 2048 and result.computed_tokens == 4 and result.passes == "padded"
    assert result.compute_seconds > 0 and result.tokens_per_second == pytest.approx(4 / result.compute_seconds)
    assert 0 < result.mfu < 1 and result.peak_tflops > 0


def test_the_token_budget_is_the_most_tokens_whose_estimated_peak_fits() -> None:
    """training/memory.py: what an unset ``chunk_tokens`` becomes on a GPU (Llama-3.2-1B's shape)."""
    from marl_pipeline.training.memory import token_budget, trainer_peak_bytes

    config = {"hidden_size": 2048, "num_hidden_layers": 16, "vocab_size": 128256, "intermediate_size": 8192,
              "tie_word_embeddings": True}
    common = {"parameters": 1_235_814_400, "trainable": 1_235_814_400, "fused_head": True}
    for checkpointing in (False, True):
        available = 60 * 2**30
        budget = token_budget(config, available=available, activation_checkpointing=checkpointing, **common)
        peak = [trainer_peak_bytes(config, tokens=tokens, activation_checkpointing=checkpointing, **common)
                for tokens in (budget, budget + 1)]
        assert peak[0] <= available < peak[1]
    kept = token_budget(config, available=available, activation_checkpointing=False, **common)
    assert budget > 5 * kept  # checkpointing keeps each layer's input alone
    assert token_budget(config, available=1, **common) == 256  # the floor: a pass of a few rows, whatever fits
