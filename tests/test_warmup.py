"""Supervised warm-up's rehearsal: a turn given no completion is held where it started (KL to the start)."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import torch

from environments.arithmetic import ArithmeticCheck, ArithmeticOptions
from marl_pipeline.bootstrap.own_replies import policy_replies, sample_replies, warmup_prompt_ids
from marl_pipeline.bootstrap.warmup import supervised_warmup
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
        model = copy.deepcopy(base)
        torch.manual_seed(0)
        losses = supervised_warmup(model, tokenizer, examples, steps=20, batch_size=8, lr=3e-3, seed=0,
                                   max_new_tokens=6)
        assert losses[-1] < losses[0]
        after[name] = _mean_logprob(model, prompt_ids, own, eos)
    assert after["taught alone"] < before - 0.5  # the drift rehearsal is for
    assert after["rehearsed"] > after["taught alone"] + 0.5 and after["rehearsed"] > before - 1.0


CHATML = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def test_context_positions_are_the_earlier_replies_and_rehearsing_them_keeps_them(tiny_model_dir: Path) -> None:
    """A verdict example's prompt holds the agent's own earlier reply as an assistant message: its positions are
    found in the template's ids, and with ``rehearse_context`` the KL there keeps that turn where it started while
    the verdict is taught; without it, the turn drifts."""
    from marl_pipeline.bootstrap.own_replies import context_reply_positions
    from marl_pipeline.inference.chat import ChatTokenizer

    base, tokenizer = load_policy(str(tiny_model_dir))
    tokenizer.chat_template = CHATML
    env = ArithmeticCheck(ArithmeticOptions())
    rng = np.random.default_rng(0)
    questions = [[{"role": "user", "content": prompt}]
                 for prompt, _ in env.warmup_examples("solver", rng, 160)]
    eos = tokenizer.eos_token_id
    prompt_ids = warmup_prompt_ids(tokenizer, questions, "the solver")
    torch.manual_seed(1)
    own = sample_replies(base, prompt_ids, max_new_tokens=6, temperature=1.0, eos=eos, pad=eos)
    texts = [tokenizer.decode(reply, skip_special_tokens=True) for reply in own]
    verdicts = [[*question, {"role": "assistant", "content": text}, {"role": "user", "content": "ok?"}]
                for question, text in zip(questions, texts)]
    positions = context_reply_positions(tokenizer, verdicts + ["1 + 2 ="], "the verifier")
    assert positions[-1] == []  # a text prompt holds no reply
    ids = warmup_prompt_ids(tokenizer, verdicts[:3], "the verifier")
    end_of_turn = ChatTokenizer(tokenizer, "the verifier").end_of_turn
    for row, found, text in zip(ids, positions[:3], texts[:3]):
        assert found == list(range(found[0], found[-1] + 1))  # one span: the reply, then its end of turn
        assert row[found[-1]] == end_of_turn
        assert tokenizer.decode([row[p] for p in found[:-1]]) == tokenizer.decode(
            tokenizer(text, add_special_tokens=False)["input_ids"])
    held_out = slice(0, 64)
    before = _mean_logprob(base, prompt_ids[held_out], own[held_out], eos)
    taught = [(prompt, "yes") for prompt in verdicts[64:]]
    after = {}
    for rehearse in (False, True):
        model = copy.deepcopy(base)
        torch.manual_seed(0)
        losses = supervised_warmup(model, tokenizer, taught, steps=20, batch_size=8, lr=3e-3, seed=0,
                                   max_new_tokens=6, rehearse_context=rehearse)
        assert losses[-1] < losses[0]
        after[rehearse] = _mean_logprob(model, prompt_ids[held_out], own[held_out], eos)
    assert after[False] < before - 0.5  # taught "yes" after its reply, the reply itself drifts
    assert after[True] > after[False] + 0.5 and after[True] > before - 1.0, (before, after)


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
        model = copy.deepcopy(base)
        torch.manual_seed(0)
        supervised_warmup(model, tokenizer, examples, steps=20, batch_size=8, lr=3e-3, seed=0, max_new_tokens=6)
        after[name] = _mean_logprob(model, prompt_ids, paths, eos)
    assert after["taught alone"] < before - 0.5
    assert abs(after["held"] - before) < 0.5 < after["held"] - after["taught alone"], (before, after)
