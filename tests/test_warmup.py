"""Supervised warm-up's rehearsal: a turn given no completion is held where it started (KL to the start)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from environments.arithmetic import ArithmeticCheck, ArithmeticOptions
from marl_pipeline.bootstrap.own_replies import policy_replies, sample_replies, warmup_prompt_ids
from marl_pipeline.bootstrap.warmup import supervised_warmup, warmup_trainer
from marl_pipeline.policy.checkpoint import load_policy
from marl_pipeline.training.losses import pad_sequences, token_logprobs


def _mean_logprob(model, prompts: list[list[int]], replies: list[list[int]], pad: int) -> float:
    with torch.no_grad():
        input_ids, attention_mask, mask = pad_sequences(prompts, replies, pad)
        return float((token_logprobs(model, input_ids, attention_mask) * mask).sum() / mask.sum())


def test_sampled_replies_stop_at_their_first_eos(tiny_model_dir: Path) -> None:
    model, tokenizer = load_policy(str(tiny_model_dir))
    env = ArithmeticCheck(ArithmeticOptions())
    prompts = warmup_prompt_ids(tokenizer, [p for p, _ in env.warmup_examples("solver", np.random.default_rng(0), 40)],
                                "the solver")
    eos = tokenizer.eos_token_id
    torch.manual_seed(0)
    replies = sample_replies(model, prompts, max_new_tokens=6, temperature=1.0, eos=eos, pad=eos, batch_size=16)
    assert len(replies) == len(prompts)
    assert all(1 <= len(reply) <= 6 and eos not in reply[:-1] for reply in replies)
    assert any(reply[-1] == eos for reply in replies) and len({tuple(reply) for reply in replies}) > 1
    texts = policy_replies(model, tokenizer, ["1 + 2 =", "3 + 4 ="], source="the solver", max_new_tokens=6,
                           temperature=1.0)
    assert len(texts) == 2 and all(isinstance(text, str) and tokenizer.eos_token not in text for text in texts)


def test_rehearsal_keeps_the_turn_that_warm_up_does_not_teach(tiny_model_dir: Path) -> None:
    """Taught a constant reply ("yes") on one prompt kind, the model drifts on another it was not taught; rehearsing
    its own replies there keeps its likelihood of them near where it started."""
    base, tokenizer = load_policy(str(tiny_model_dir))
    env = ArithmeticCheck(ArithmeticOptions())
    rng = np.random.default_rng(0)
    taught = [(prompt, "yes") for prompt, _ in env.warmup_examples("verifier", rng, 200)]
    questions = [prompt for prompt, _ in env.warmup_examples("solver", rng, 200)]
    eos = tokenizer.eos_token_id
    prompt_ids = warmup_prompt_ids(tokenizer, questions[:64], "the solver")
    torch.manual_seed(1)
    own = sample_replies(base, prompt_ids, max_new_tokens=6, temperature=1.0, eos=eos, pad=eos)  # held out
    before = _mean_logprob(base, prompt_ids, own, eos)
    after = {}
    for name, examples in {"taught alone": taught,
                           "rehearsed": taught + [(q, None) for q in questions[64:]]}.items():
        trainer = warmup_trainer(str(tiny_model_dir), lr=3e-3, seed=0)
        losses = supervised_warmup(trainer, examples, steps=20, batch_size=8, seed=0, max_new_tokens=6)
        assert losses[-1] < losses[0]
        after[name] = _mean_logprob(trainer.model, prompt_ids, own, eos)
    assert after["taught alone"] < before - 0.5  # the drift rehearsal is for
    assert after["rehearsed"] > after["taught alone"] + 0.5 and after["rehearsed"] > before - 1.0


def test_a_rehearsal_holds_the_path_it_gives(tiny_model_dir: Path) -> None:
    """A ``Rehearsal`` completion is held along its own tokens (the KL), not sampled and not taught: the model's
    likelihood of those paths stays where it started while a constant verdict is taught beside them."""
    from marl_pipeline.environment import Rehearsal

    base, tokenizer = load_policy(str(tiny_model_dir))
    env = ArithmeticCheck(ArithmeticOptions())
    rng = np.random.default_rng(0)
    taught = [(prompt, "yes") for prompt, _ in env.warmup_examples("verifier", rng, 200)]
    solved = env.warmup_examples("solver", rng, 120)  # (question, its right answer)
    eos = tokenizer.eos_token_id
    prompt_ids = warmup_prompt_ids(tokenizer, [q for q, _ in solved], "the solver")
    paths = [tokenizer(answer, add_special_tokens=False)["input_ids"] + [eos] for _, answer in solved]
    before = _mean_logprob(base, prompt_ids, paths, eos)
    after = {}
    for name, examples in {"taught alone": taught,
                           "held": taught + [(q, Rehearsal(answer)) for q, answer in solved]}.items():
        trainer = warmup_trainer(str(tiny_model_dir), lr=3e-3, seed=0)
        supervised_warmup(trainer, examples, steps=20, batch_size=8, seed=0, max_new_tokens=6)
        after[name] = _mean_logprob(trainer.model, prompt_ids, paths, eos)
    assert after["taught alone"] < before - 0.5
    assert abs(after["held"] - before) < 0.5 < after["held"] - after["taught alone"], (before, after)


def test_a_warmup_step_is_the_plain_step_on_the_supervised_loss(tiny_model_dir: Path) -> None:
    """The warm-up trains through the RL trainer: one step over taught, kept and path-held rows, in passes of a few
    tokens, has the gradient of the batch's mean over its completion tokens of cross-entropy, KL from the start and
    the held path's squared difference, computed here from the full logits."""
    from marl_pipeline.training.batches import SupervisedBatch

    model, tokenizer = load_policy(str(tiny_model_dir))
    trainer = warmup_trainer(str(tiny_model_dir), lr=1e-2, seed=0, chunk_tokens=12)
    with torch.no_grad():  # both start off the base, so the KL and the held path have a gradient
        for mine, theirs in zip(trainer.model.parameters(), model.parameters()):
            mine.add_(0.05 * torch.randn_like(mine))
            theirs.copy_(mine)
    start, _ = load_policy(str(tiny_model_dir))
    trainer.reference = start.eval().requires_grad_(False)
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    prompts = [encode("1 + 2 ="), encode("30 + 4 ="), encode("5 + 5 =")]
    responses = [encode(" 3"), encode(" 34 yes"), encode(" 10")]
    terms = ["teach", "keep", "keep_path"]
    stats = trainer.accumulate_supervised(SupervisedBatch(prompts, responses, terms))

    input_ids, attention_mask, mask = pad_sequences(prompts, responses, tokenizer.eos_token_id)
    log_probs = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1].log_softmax(-1)
    with torch.no_grad():
        start_log_probs = start(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1].log_softmax(-1)
    taken = log_probs.gather(2, input_ids[:, 1:, None]).squeeze(-1)
    start_taken = start_log_probs.gather(2, input_ids[:, 1:, None]).squeeze(-1)
    kl = (start_log_probs.exp() * (start_log_probs - log_probs)).sum(-1)
    token_loss = torch.stack([-taken[0], kl[1], kl[2] + (taken[2] - start_taken[2]) ** 2])
    loss = (token_loss * mask).sum() / mask.sum()
    assert stats["tokens"] == int(mask.sum())
    assert stats["loss_sum"] / stats["tokens"] == pytest.approx(loss.item(), rel=1e-5)
    loss.backward()
    for mine, theirs in zip(trainer.model.parameters(), model.parameters()):  # the step divides by the tokens
        scale = float(theirs.grad.abs().max())
        assert torch.allclose(mine.grad / stats["tokens"], theirs.grad, rtol=0, atol=1e-5 * scale)
    result = trainer.apply_step()
    assert (result.tokens, result.lr, result.policy_version) == (stats["tokens"], 1e-2, 1)
