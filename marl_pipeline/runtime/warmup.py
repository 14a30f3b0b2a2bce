"""Supervised warm-up: teaches a base policy the environment's turn format before RL starts.

Rehearsal: an example whose completion is ``None`` keeps the policy's reply to its prompt as it was. Fine-tuning a
chat model on one turn alone moves its other turns: 30 steps on "Yes"/"No" verdicts made SmolLM2-135M answer "No"
to "What is 25 + 5?" too (BENCHMARKS.md). Its own reply is sampled before warm-up as rollout samples (temperature,
no top-k or top-p) and kept as ids; at each of its positions the loss is the KL from the policy as it started (a
frozen copy) to the policy now, over the whole vocabulary. The sampled tokens' own likelihood has the same
gradient in expectation but one token's worth of it, far noisier: trained on it at lr 5e-5, SmolLM2's working
drifted to the verdict's first word; with the KL (and its own workings in the verdict examples) it moved 0.06 nats
a token (bench/verdict_cold_start.py, BENCHMARKS.md).

Rehearsal in context (``rehearse_context``): a chat example's prompt may hold the agent's own earlier reply as an
assistant message (a verdict example holds the working it follows). Those positions are context, never taught; with
``rehearse_context`` they are scored by the same KL, so every such example also holds the earlier turn where it
was. Without it, SmolLM2's verdict cold start halved its working's accuracy at temperature 1 (3.5% -> 1.5% of
samples on the training questions) though the greedy working was unchanged, and RL then found one right working in
13 steps (BENCHMARKS.md).
"""

from __future__ import annotations

import copy

import numpy as np
import torch

from marl_pipeline.environment import ChatMessages
from marl_pipeline.runtime.chat import ChatTokenizer
from marl_pipeline.runtime.losses import next_token_log_probs, pad_sequences
from marl_pipeline.runtime.precision import autocast


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


def context_reply_positions(tokenizer, prompts: list[str | ChatMessages], source: str) -> list[list[int]]:
    """For each prompt, the token positions of its assistant messages (their content and end-of-turn token) in the
    ids ``warmup_prompt_ids`` gives it: the agent's earlier replies the prompt holds as context. None for a text
    prompt; a template that renders an earlier part of the conversation differently once more follows is an error."""
    chat, positions = None, []
    for prompt in prompts:
        found: list[int] = []
        if not isinstance(prompt, str):
            chat = chat or ChatTokenizer(tokenizer, source)
            full = chat.first_ids(prompt)
            for index, message in enumerate(prompt):
                if message["role"] != "assistant":
                    continue
                before = chat.first_ids(prompt[:index])  # up to the assistant's header
                through = chat.first_ids(prompt[:index + 1])  # ... and the reply, then the next header
                end = len(before) + through[len(before):].index(chat.end_of_turn) if (
                    chat.end_of_turn in through[len(before):]) else -1
                if full[:len(before)] != before or end < 0 or full[:end + 1] != through[:end + 1]:
                    raise ValueError(f"the chat template of {source} renders message {index} of a warm-up prompt "
                                     "differently once more messages follow, so its reply cannot be rehearsed")
                found.extend(range(len(before), end + 1))
        positions.append(found)
    return positions


@torch.no_grad()
def sample_replies(model, prompts: list[list[int]], *, max_new_tokens: int, temperature: float, eos: int, pad: int,
                   batch_size: int = 32) -> list[list[int]]:
    """The model's own reply to each prompt, as rollout samples it: ids up to and including the first EOS (all
    ``max_new_tokens`` of them when it never stops, with no EOS added, as the engine would return them)."""
    from transformers import GenerationConfig

    # Explicit, not the checkpoint's generation_config: SmolLM2's asks for top-p 0.9 at temperature 0.2.
    generation = GenerationConfig(do_sample=True, temperature=temperature, top_k=0, top_p=1.0,
                                  max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=pad)
    model.eval()
    replies = []
    for start in range(0, len(prompts), batch_size):
        batch = prompts[start:start + batch_size]
        width = max(len(ids) for ids in batch)
        input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids in batch])  # left-padded: replies align
        attention_mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in batch])
        output = model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=generation)
        for row in output[:, width:].tolist():
            replies.append(row[:row.index(eos) + 1] if eos in row else row)
    return replies


def policy_replies(model, tokenizer, prompts: list[str | ChatMessages], *, source: str, max_new_tokens: int,
                   temperature: float) -> list[str]:
    """The policy's own reply to each prompt, sampled as rollout samples, as text: what a plugin's
    ``own_reply_warmup_examples`` builds its examples on (their prompts then hold the replies as messages)."""
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    ids = sample_replies(model, warmup_prompt_ids(tokenizer, prompts, source), max_new_tokens=max_new_tokens,
                         temperature=temperature, eos=eos, pad=pad)
    return [tokenizer.decode(reply, skip_special_tokens=True) for reply in ids]


def supervised_warmup(model, tokenizer, examples: list[tuple[str | ChatMessages, str | None]], *, steps: int,
                      batch_size: int, lr: float, seed: int, source: str = "the policy", max_new_tokens: int = 16,
                      temperature: float = 1.0, dtype: torch.dtype = torch.float32,
                      chunk_tokens: int = 512, rehearse_context: bool = False) -> list[float]:
    """Fine-tune ``model`` on (prompt, completion) pairs, loss on the completion and its EOS only.

    Prompt and completion are tokenized separately and concatenated, as the rollout engine sees them (the prompt's
    ids as rollout sends them: ``warmup_prompt_ids``; sampled tokens follow). A ``None`` completion is rehearsal:
    the model's own reply (``sample_replies``, ``max_new_tokens`` at ``temperature``), drawn once for each such
    example a batch uses, before the first step, and scored by the KL from the starting policy at its positions.
    Forward passes run in ``dtype`` autocast (the agent's trainer precision: bf16 where the hardware has it,
    float32 master weights), over passes of at most ``chunk_tokens`` tokens (the agent's trainer setting) whose
    gradients add up to the batch's. ``rehearse_context``: the KL also at the positions of the assistant messages a
    chat prompt holds (``context_reply_positions``). Returns the loss of each step (the mean over scored positions).
    """
    rng = np.random.default_rng(seed)
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    batches = rng.integers(0, len(examples), size=(steps, batch_size))
    prompts = warmup_prompt_ids(tokenizer, [p for p, _ in examples], source)
    completions = {i: tokenizer(c, add_special_tokens=False)["input_ids"] + [eos]
                   for i, (_, c) in enumerate(examples) if c is not None}
    context = (context_reply_positions(tokenizer, [p for p, _ in examples], source) if rehearse_context
               else [[] for _ in examples])
    rehearsed = sorted({int(i) for i in batches.flat} - completions.keys())
    own = sample_replies(model, [prompts[i] for i in rehearsed], max_new_tokens=max_new_tokens,
                         temperature=temperature, eos=eos, pad=pad)
    completions.update(zip(rehearsed, own))
    # the policy as it started, frozen
    reference = copy.deepcopy(model).eval() if rehearsed or any(context) else None
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    losses = []
    for rows in batches:
        targets = sum(len(completions[i]) + len(context[i]) for i in rows)
        loss = 0.0
        for chunk in _chunks([int(i) for i in rows], [len(prompts[i]) + len(completions[i]) for i in rows],
                             chunk_tokens):
            input_ids, attention_mask, mask = pad_sequences([prompts[i] for i in chunk],
                                                            [completions[i] for i in chunk], pad)
            taught = torch.tensor([examples[i][1] is not None for i in chunk])[:, None] * mask
            kept = mask - taught  # rehearsed completions, and the replies in context: scored by the KL
            for row, i in enumerate(chunk):
                kept[row, [position - 1 for position in context[i]]] = 1.0  # the logits at t predict token t + 1
            with autocast(dtype, "cpu"):
                log_probs = next_token_log_probs(model, input_ids, attention_mask)
            taken = torch.gather(log_probs, 2, input_ids[:, 1:, None]).squeeze(-1)
            chunk_loss = -(taken * taught).sum()  # cross-entropy on the taught completions
            if kept.any():
                with torch.no_grad(), autocast(dtype, "cpu"):
                    start = next_token_log_probs(reference, input_ids, attention_mask)
                chunk_loss = chunk_loss + ((start.exp() * (start - log_probs)).sum(-1) * kept).sum()
            chunk_loss = chunk_loss / targets  # the batch's mean over its target tokens
            chunk_loss.backward()
            loss += float(chunk_loss.detach())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss)
    return losses


def _chunks(rows: list[int], lengths: list[int], chunk_tokens: int) -> list[list[int]]:
    """Consecutive rows in passes of at most ``chunk_tokens`` tokens (a longer row alone): the logits of a pass
    (tokens x vocabulary, float32) stay small, which trains several times more tokens a second on a CPU
    (BENCHMARKS.md, trainer precision), with the same gradient as one pass."""
    chunks: list[list[int]] = [[]]
    used = 0
    for row, length in zip(rows, lengths):
        if chunks[-1] and used + length > chunk_tokens:
            chunks.append([])
            used = 0
        chunks[-1].append(row)
        used += length
    return chunks
