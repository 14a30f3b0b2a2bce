"""The per-token terms the losses need, computed on the scored positions alone and in chunks: the same values and
gradients as the full logits, without a [tokens x vocabulary] float32 tensor for the whole pass."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from marl_pipeline.policy.checkpoint import load_policy
from marl_pipeline.training.losses import pad_sequences, scored_token_terms


def _batch(tokenizer):
    prompts = [tokenizer("3 + 4 =")["input_ids"], tokenizer("12 + 30 = ")["input_ids"]]
    responses = [tokenizer(" 7")["input_ids"] + [tokenizer.eos_token_id], tokenizer("42")["input_ids"]]
    return pad_sequences(prompts, responses, tokenizer.eos_token_id)


def test_terms_on_the_scored_positions_equal_the_full_logits_in_any_chunk(tiny_model_dir: Path) -> None:
    model, tokenizer = load_policy(str(tiny_model_dir))
    start, _ = load_policy(str(tiny_model_dir))
    with torch.no_grad():  # a start model that differs from the policy, so the KL is not zero
        for param in start.parameters():
            param.add_(0.01 * torch.randn_like(param))
    input_ids, attention_mask, mask = _batch(tokenizer)
    taken = mask.bool()
    full = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1].log_softmax(-1)
    start_full = start(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1].log_softmax(-1).detach()
    targets = input_ids[:, 1:, None]
    expected = {"logprobs": full.gather(2, targets).squeeze(-1)[taken],
                "entropy": -(full.exp() * full).sum(-1)[taken],
                "start_logprobs": start_full.gather(2, targets).squeeze(-1)[taken],
                "start_kl": (start_full.exp() * (start_full - full)).sum(-1)[taken]}
    (expected["logprobs"].sum() + expected["start_kl"].sum()).backward()
    expected_grads = [param.grad.clone() for param in model.parameters()]
    for chunk in (1, 2, 1024):  # one position per chunk, a chunk cut inside a row, all at once
        model.zero_grad()
        terms = scored_token_terms(model, input_ids, attention_mask, taken, entropy=True, start=start, chunk=chunk)
        for name, values in expected.items():
            assert getattr(terms, name).tolist() == pytest.approx(values.tolist(), abs=1e-5), (name, chunk)
        (terms.logprobs.sum() + terms.start_kl.sum()).backward()
        for param, grad in zip(model.parameters(), expected_grads):
            assert torch.allclose(param.grad, grad, atol=1e-5), chunk
        assert terms.scattered("logprobs", taken)[taken].tolist() == terms.logprobs.tolist()
        assert (terms.scattered("logprobs", taken)[~taken] == 0).all()


@pytest.mark.parametrize("entropy", [False, True], ids=["logprobs", "logprobs+entropy"])
def test_the_fused_head_gives_the_unfused_heads_terms_and_gradients(tiny_model_dir: Path, entropy: bool) -> None:
    """training/head.py, eager here (compiled on CUDA: tests/gpu), in float64: the same values and gradients, with
    the gradients of both terms weighted as a loss weighs them, in chunks that cut rows."""
    model, tokenizer = load_policy(str(tiny_model_dir))
    model.double()
    input_ids, attention_mask, mask = _batch(tokenizer)
    taken = mask.bool()
    figures = []
    for fused in (False, True):
        model.zero_grad()
        terms = scored_token_terms(model, input_ids, attention_mask, taken, entropy=entropy, chunk=2, fused=fused)
        weights = torch.linspace(-1.0, 2.0, len(terms.logprobs), dtype=torch.float64)
        loss = (terms.logprobs * weights).sum() + (0.3 * terms.entropy.sum() if entropy else 0.0)
        loss.backward()
        figures.append((terms, [param.grad.clone() for param in model.parameters()]))
    (unfused, unfused_grads), (fused_terms, fused_grads) = figures
    assert torch.allclose(fused_terms.logprobs, unfused.logprobs, atol=1e-6)  # both leave the head in float32
    assert (fused_terms.entropy is None) == (not entropy)
    if entropy:
        assert torch.allclose(fused_terms.entropy, unfused.entropy, atol=1e-6)
    for fused_grad, unfused_grad in zip(fused_grads, unfused_grads):
        # float32 inside either head (the logits' softmax): rounding-level apart, against the largest gradient
        assert (fused_grad - unfused_grad).abs().max() <= 1e-6 * unfused_grad.abs().max()
    assert max(grad.abs().max() for grad in fused_grads) > 1e-3  # a gradient to compare


_PEAK = textwrap.dedent("""
    import json, sys
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from marl_pipeline.training.losses import scored_token_terms
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=32000, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2, head_dim=32))
    ids = torch.randint(0, 32000, (1, 4096))
    every = torch.ones(1, 4095, dtype=torch.bool)
    def peak():  # this process image's peak resident memory (getrusage's maxrss would count the parent's, from fork)
        return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
    before = peak()
    if sys.argv[1] == "chunked":
        loss = scored_token_terms(model, ids, torch.ones_like(ids), every, chunk=256).logprobs.sum()
    else:  # the full logits of the pass, as a plain training loop computes them
        loss = model(input_ids=ids).logits[:, :-1].float().log_softmax(-1).gather(2, ids[:, 1:, None]).sum()
    loss.backward()
    print(json.dumps((peak() - before) * 1024))
""")


@pytest.mark.launch
def test_peak_memory_stays_below_the_full_logits() -> None:
    """4,095 positions over a 32,000-token vocabulary: their float32 logits alone are 524 MB. In chunks of 256
    positions, the pass's peak grows by at most four chunks' logits (a chunk's logits and log-softmax, and their
    gradients, LOGIT_CHUNK's bound) and 64 MB for the rest of the pass (measured: 150 MB in all); computed whole
    (the check that the measure can fail), by more than all the logits (measured: 1.6 GB)."""
    logits_bytes = 4095 * 32000 * 4
    chunk_bytes = 256 * 32000 * 4
    # glibc's malloc would serve freed blocks of a few MB again from its heap and keep them in the process's resident
    # memory; a fixed mmap threshold returns every large tensor to the system when it is freed, so the peak is
    # the tensors'.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "1048576"}
    growth = {how: json.loads(subprocess.run([sys.executable, "-c", _PEAK, how], check=True, capture_output=True,
                                             text=True, env=env).stdout)
              for how in ("chunked", "whole")}
    assert growth["whole"] > logits_bytes, growth
    assert growth["chunked"] < 4 * chunk_bytes + 64e6 < logits_bytes / 2, growth
