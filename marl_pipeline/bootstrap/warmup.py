"""Supervised warm-up: teaches a base policy the environment's turn format before RL starts.

Rehearsal: an example whose completion is ``None`` keeps the policy's reply to its prompt as it was, so that
teaching one turn leaves the others where they were. Its own reply is sampled before warm-up as rollout samples
(temperature, no top-k or top-p) and kept as ids; at each of its positions the loss is the KL from the policy as it
started (a frozen copy) to the policy now, over the whole vocabulary: the sampled tokens' own likelihood has the
same gradient in expectation but far noisier. A ``Rehearsal`` completion is held the same way along the path it
gives, and its own tokens' log-probabilities held to where they started as well (a squared difference), which the
KL alone barely does for a token the model rarely samples. With ``rehearse_context``, the agent's own earlier
replies that a chat example's prompt holds are scored by the same KL. Why each, with the measurements:
docs/ARCHITECTURE.md, "Warm-up rehearsal".
"""

from __future__ import annotations

import copy

import numpy as np
import torch

from marl_pipeline.bootstrap.own_replies import context_reply_positions, sample_replies, warmup_prompt_ids
from marl_pipeline.environment import ChatMessages, Rehearsal
from marl_pipeline.policy.precision import autocast
from marl_pipeline.training.losses import next_token_log_probs, pad_sequences


def supervised_warmup(model, tokenizer, examples: list[tuple[str | ChatMessages, str | Rehearsal | None]], *,
                      steps: int, batch_size: int, lr: float, seed: int, source: str = "the policy",
                      max_new_tokens: int = 16, temperature: float = 1.0, dtype: torch.dtype = torch.float32,
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
    completions = {i: tokenizer(c if isinstance(c, str) else c.text, add_special_tokens=False)["input_ids"] + [eos]
                   for i, (_, c) in enumerate(examples) if c is not None}  # a Rehearsal's path is given
    context = (context_reply_positions(tokenizer, [p for p, _ in examples], source) if rehearse_context
               else [[] for _ in examples])
    rehearsed = sorted({int(i) for i in batches.flat} - completions.keys())
    own = sample_replies(model, [prompts[i] for i in rehearsed], max_new_tokens=max_new_tokens,
                         temperature=temperature, eos=eos, pad=pad)
    completions.update(zip(rehearsed, own))
    held = any(not isinstance(examples[int(i)][1], str) for i in batches.flat) or any(context)
    reference = copy.deepcopy(model).eval() if held else None  # the policy as it started, frozen
    optimizer = torch.optim.AdamW([param for param in model.parameters() if param.requires_grad], lr=lr)
    model.train()
    losses = []
    for rows in batches:
        targets = sum(len(completions[i]) + len(context[i]) for i in rows)
        loss = 0.0
        for chunk in _chunks([int(i) for i in rows], [len(prompts[i]) + len(completions[i]) for i in rows],
                             chunk_tokens):
            input_ids, attention_mask, mask = pad_sequences([prompts[i] for i in chunk],
                                                            [completions[i] for i in chunk], pad)
            taught = torch.tensor([isinstance(examples[i][1], str) for i in chunk])[:, None] * mask
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
                # A given path's own tokens held too: the KL weighs a token by its starting probability, so it
                # barely holds a rare one (a small model's right answer), which is what a Rehearsal is given for.
                path = torch.tensor([isinstance(examples[i][1], Rehearsal) for i in chunk])[:, None] * mask
                start_taken = torch.gather(start, 2, input_ids[:, 1:, None]).squeeze(-1)
                chunk_loss = chunk_loss + ((taken - start_taken) ** 2 * path).sum()
            chunk_loss = chunk_loss / targets  # the batch's mean over its target tokens
            chunk_loss.backward()
            loss += float(chunk_loss.detach())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss)
    return losses


def _chunks(rows: list[int], lengths: list[int], chunk_tokens: int) -> list[list[int]]:
    """Consecutive rows in passes of at most ``chunk_tokens`` tokens (a longer row alone): the logits of a pass
    (tokens x vocabulary, float32) stay small, with the same gradient as one pass."""
    chunks: list[list[int]] = [[]]
    used = 0
    for row, length in zip(rows, lengths):
        if chunks[-1] and used + length > chunk_tokens:
            chunks.append([])
            used = 0
        chunks[-1].append(row)
        used += length
    return chunks
