"""Supervised warm-up: teaches a base policy the environment's turn format before RL starts, through the agent's
own trainer (``training/trainer.py``: its passes, precision and device; a constant learning rate, no clipping).

Rehearsal: an example whose completion is ``None`` keeps the policy's reply to its prompt as it was, so that
teaching one turn leaves the others where they were. Its own reply is sampled before warm-up as rollout samples
(temperature, no top-k or top-p) and kept as ids; at each of its positions the loss is the KL from the policy as it
started (a frozen copy) to the policy now, over the whole vocabulary: the sampled tokens' own likelihood has the
same gradient in expectation but far noisier. A ``Rehearsal`` completion is held the same way along the path it
gives, and its own tokens' log-probabilities held to where they started as well (a squared difference), which the
KL alone barely does for a token the model rarely samples. Why each, with the measurements: docs/ARCHITECTURE.md,
"Warm-up rehearsal".
"""

from __future__ import annotations

import numpy as np

from marl_pipeline.bootstrap.own_replies import sample_replies, warmup_prompt_ids
from marl_pipeline.environment import ChatMessages, Rehearsal
from marl_pipeline.training.batches import SupervisedBatch
from marl_pipeline.training.trainer import PolicyTrainer

WARMUP_WEIGHT_DECAY = 0.01  # torch's AdamW default, what the warm-up has always used


def warmup_trainer(model_dir: str, *, lr: float, seed: int, lora: dict | None = None, **options) -> PolicyTrainer:
    """A trainer for the warm-up of the policy in ``model_dir``: every weight, or fresh ``lora`` adapters over it;
    ``options`` are the agent's trainer settings (threads, dtype, chunk_tokens)."""
    return PolicyTrainer(model_dir, 0, lr=lr, weight_decay=WARMUP_WEIGHT_DECAY, max_grad_norm=float("inf"),
                         clip_eps=0.0, seed=seed, lora=lora, base_dir=model_dir if lora else None, **options)


def supervised_warmup(trainer: PolicyTrainer, examples: list[tuple[str | ChatMessages, str | Rehearsal | None]], *,
                      steps: int, batch_size: int, seed: int, source: str = "the policy", max_new_tokens: int = 16,
                      temperature: float = 1.0) -> list[float]:
    """Fine-tune the trainer's policy on (prompt, completion) pairs, loss on the completion and its EOS only.

    Prompt and completion are tokenized separately and concatenated, as the rollout engine sees them (the prompt's
    ids as rollout sends them: ``warmup_prompt_ids``; sampled tokens follow). A ``None`` completion is rehearsal:
    the model's own reply (``sample_replies``, ``max_new_tokens`` at ``temperature``), drawn once for each such
    example a batch uses, before the first step, and scored by the KL from the starting policy at its positions.
    Each step is the batch's mean over its completion tokens. Returns the loss of each step.
    """
    tokenizer = trainer.tokenizer
    rng = np.random.default_rng(seed)
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    batches = rng.integers(0, len(examples), size=(steps, batch_size))
    prompts = warmup_prompt_ids(tokenizer, [p for p, _ in examples], source)
    completions = {i: tokenizer(c if isinstance(c, str) else c.text, add_special_tokens=False)["input_ids"] + [eos]
                   for i, (_, c) in enumerate(examples) if c is not None}  # a Rehearsal's path is given
    rehearsed = sorted({int(i) for i in batches.flat} - completions.keys())
    own = sample_replies(trainer.model, [prompts[i] for i in rehearsed], max_new_tokens=max_new_tokens,
                         temperature=temperature, eos=eos, pad=pad)
    completions.update(zip(rehearsed, own))
    terms = ["teach" if isinstance(c, str) else "keep_path" if isinstance(c, Rehearsal) else "keep"
             for _, c in examples]
    if any(terms[int(i)] != "teach" for i in batches.flat):
        trainer.keep_start_copy()  # the policy as it started, frozen
    trainer.model.train()
    losses = []
    for rows in batches:
        rows = [int(i) for i in rows]
        stats = trainer.accumulate_supervised(SupervisedBatch([prompts[i] for i in rows],
                                                              [completions[i] for i in rows],
                                                              [terms[i] for i in rows]))
        trainer.apply_step()
        losses.append(stats["loss_sum"] / max(stats["tokens"], 1))
    return losses
