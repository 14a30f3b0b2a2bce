"""Supervised warm-up: teaches a base policy the environment's turn format before RL starts."""

from __future__ import annotations

import numpy as np
import torch

from marl_pipeline.environment import ChatMessages
from marl_pipeline.runtime.chat import ChatTokenizer
from marl_pipeline.runtime.losses import pad_sequences, token_logprobs


def warmup_prompt_ids(tokenizer, prompts: list[str | ChatMessages], source: str) -> list[list[int]]:
    """Each prompt's ids as rollout would send them to the engine: text tokenized as it is, chat messages through
    the agent's chat template (``runtime/chat.py``, which says which agent lacks one)."""
    chat, ids = None, []
    for prompt in prompts:
        if isinstance(prompt, str):
            ids.append(tokenizer(prompt, add_special_tokens=False)["input_ids"])
            continue
        chat = chat or ChatTokenizer(tokenizer, source)
        ids.append(chat.first_ids(prompt))
    return ids


def supervised_warmup(model, tokenizer, examples: list[tuple[str | ChatMessages, str]], *, steps: int,
                      batch_size: int, lr: float, seed: int, source: str = "the policy") -> list[float]:
    """Fine-tune ``model`` on (prompt, completion) pairs, loss on the completion and its EOS only.

    Prompt and completion are tokenized separately and concatenated, as the rollout engine sees them (the prompt's
    ids as rollout sends them: ``warmup_prompt_ids``; sampled tokens follow). Returns the loss of each step.
    """
    rng = np.random.default_rng(seed)
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    prompts = warmup_prompt_ids(tokenizer, [p for p, _ in examples], source)
    completions = [tokenizer(c, add_special_tokens=False)["input_ids"] + [eos] for _, c in examples]
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    losses = []
    for _ in range(steps):
        rows = rng.integers(0, len(examples), size=batch_size)
        input_ids, attention_mask, mask = pad_sequences([prompts[i] for i in rows], [completions[i] for i in rows], pad)
        logprobs = token_logprobs(model, input_ids, attention_mask)
        loss = -(logprobs * mask).sum() / mask.sum()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses
