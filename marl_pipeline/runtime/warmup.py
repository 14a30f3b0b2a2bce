"""Supervised warm-up: teaches a base policy the environment's turn format before RL starts."""

from __future__ import annotations

import numpy as np
import torch

from marl_pipeline.runtime.losses import pad_sequences, token_logprobs


def rendered_examples(tokenizer, examples: list[tuple], agent: str) -> list[tuple[str, str]]:
    """(prompt, completion) pairs with chat-message prompts rendered by the agent's chat template, generation prompt
    included: the text whose ids (its special tokens read as such) are the ids rollout sends the engine."""
    rendered = []
    for prompt, completion in examples:
        if isinstance(prompt, list):
            if not getattr(tokenizer, "chat_template", None):
                raise ValueError(f"agent {agent!r}: the environment's warm-up examples are chat messages, but the "
                                 "agent's tokenizer has no chat template (the built-in tiny model takes text)")
            prompt = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        rendered.append((prompt, completion))
    return rendered


def supervised_warmup(model, tokenizer, examples: list[tuple[str, str]], *, steps: int, batch_size: int,
                      lr: float, seed: int) -> list[float]:
    """Fine-tune ``model`` on (prompt, completion) pairs, loss on the completion and its EOS only.

    Prompt and completion are tokenized separately and concatenated, as the rollout engine sees them
    (the engine tokenizes the prompt; sampled tokens follow). Returns the loss of each step.
    """
    rng = np.random.default_rng(seed)
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    prompts = [tokenizer(p, add_special_tokens=False)["input_ids"] for p, _ in examples]
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
