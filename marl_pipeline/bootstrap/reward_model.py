"""The run's reward model directory, and the built-in one: ``builtin:tiny`` is a 2-layer Qwen2 sequence classifier
trained at launch on the environment's ``reward_examples`` (prompt, response, label) with the run's built-in
tokenizer, a learned outcome verifier small enough for CPU runs and tests. It is saved in the store beside the
built-in policy."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from marl_pipeline.bootstrap.tiny_model import BUILTIN_MODEL, TINY_ARCHITECTURE, train_tokenizer
from marl_pipeline.config import BUILTIN_TINY, ExperimentConfig
from marl_pipeline.policy.checkpoint import save_policy
from marl_pipeline.store import ExperienceStore

REWARD_MODEL = "reward"
"""The built-in reward model's name among the run's models in the store (``run=R/models/name=reward``)."""


def prepare_reward_model(config: ExperimentConfig, env, store) -> Path | None:
    """The run's reward model directory (the built-in one trained and committed in the store on first use, then
    fetched into this node's cache); None without a reward model."""
    if config.reward_model is None:
        return None
    if config.reward_model.model != BUILTIN_TINY:
        directory = Path(config.reward_model.model)
        if not (directory / "config.json").is_file():
            raise FileNotFoundError(f"reward_model.model {str(directory)!r} is not a Hugging Face model directory "
                                    f"(no config.json)")
        return directory
    if 0 not in store.models.versions(config.run, REWARD_MODEL):
        _train_builtin(config, env, store)
    return store.models.fetch(config.run, REWARD_MODEL, 0)


def _train_builtin(config: ExperimentConfig, env, store: ExperienceStore) -> None:
    """Train the built-in reward model on the plugin's examples and commit it in the store."""
    examples = env.reward_examples(np.random.default_rng([config.seed, 1]), 4000)
    # The run's built-in tokenizer, where its agents are on the built-in model (else one trained on the examples)
    builtin = (store.models.fetch(config.run, BUILTIN_MODEL, 0)
               if 0 in store.models.versions(config.run, BUILTIN_MODEL) else None)
    staging = store.models.staging(config.run, REWARD_MODEL, 0)
    train_tiny_reward_model(staging, examples, steps=config.reward_model.train_steps, seed=config.seed,
                            tokenizer_dir=builtin)
    store.models.commit(staging, config.run, REWARD_MODEL, 0)


def train_tiny_reward_model(directory: Path, examples: list[tuple[str, str, float]], *, steps: int, seed: int,
                            batch_size: int = 32, lr: float = 3e-4, tokenizer_dir: Path | None = None) -> list[float]:
    """Train and save the built-in classifier on (prompt, response, label in [0, 1]); returns the step losses."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForSequenceClassification

    if not examples:
        raise ValueError("no reward examples to train the built-in reward model on")
    texts = [p + r for p, r, _ in examples]
    labels = torch.tensor([float(label) for *_, label in examples])
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir) if tokenizer_dir else train_tokenizer(texts)
    tokenizer.padding_side = "right"
    torch.manual_seed(seed)
    model = Qwen2ForSequenceClassification(Qwen2Config(
        vocab_size=len(tokenizer), num_labels=1, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False,
        **TINY_ARCHITECTURE))
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    rng = np.random.default_rng(seed)
    model.train()
    losses = []
    for _ in range(steps):
        rows = rng.integers(0, len(texts), size=batch_size)
        batch = tokenizer([texts[i] for i in rows], return_tensors="pt", padding=True, add_special_tokens=False)
        logits = model(**batch).logits[:, 0]
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels[rows])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    save_policy(model, tokenizer, directory)
    return losses
