"""The run's reward model directory, and the built-in one: ``builtin:tiny`` is a judge, a causal LM of the built-in
model's size and tokenizer taught on the environment's ``reward_examples`` (prompt, response, label) to answer
``judge_yes`` or ``judge_no`` after ``judge_template``. It trains through the agents' own trainer
(``training/trainer.py``: supervised rows whose one response token is the verdict), in a Ray task with the reward
model's resources and device, and is committed in the store beside the built-in policy."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from marl_pipeline.bootstrap.tiny_model import BUILTIN_MODEL, build_tiny_model, train_tokenizer
from marl_pipeline.bootstrap.warmup import warmup_trainer
from marl_pipeline.config import BUILTIN_TINY, ExperimentConfig, StoreConfig
from marl_pipeline.policy.checkpoint import save_policy
from marl_pipeline.store import ExperienceStore
from marl_pipeline.training.batches import SupervisedBatch

REWARD_MODEL = "reward"
"""The built-in reward model's name among the run's models in the store (``run=R/models/name=reward``)."""


def prepare_reward_model(config: ExperimentConfig, env, store: ExperienceStore) -> Path | None:
    """The run's reward model directory (the built-in one trained and committed in the store on first use, in a Ray
    task when Ray is up, then fetched into this node's cache); None without a reward model."""
    if config.reward_model is None:
        return None
    if config.reward_model.model != BUILTIN_TINY:
        directory = Path(config.reward_model.model)
        if not (directory / "config.json").is_file():
            raise FileNotFoundError(f"reward_model.model {str(directory)!r} is not a Hugging Face model directory "
                                    f"(no config.json)")
        return directory
    if 0 not in store.models.versions(config.run, REWARD_MODEL):
        import ray

        if ray.is_initialized():
            settings = config.reward_model
            threads = max(1, int(ray.cluster_resources().get("CPU", 1)))  # nothing else runs yet
            task = ray.remote(_train_builtin).options(num_cpus=settings.num_cpus, num_gpus=settings.num_gpus)
            ray.get(task.remote(config, env, store.config, threads))
        else:
            _train_builtin(config, env, store.config)
    return store.models.fetch(config.run, REWARD_MODEL, 0)


def _train_builtin(config: ExperimentConfig, env, store_config: StoreConfig, threads: int | None = None) -> None:
    """Teach the built-in judge on the plugin's examples and commit it in the store (unless it is there already)."""
    store = ExperienceStore(store_config)
    if 0 in store.models.versions(config.run, REWARD_MODEL):
        return
    settings = config.reward_model
    examples = env.reward_examples(np.random.default_rng([config.seed, 1]), 4000)
    # The run's built-in tokenizer, where its agents are on the built-in model (else one trained on the examples)
    builtin = (store.models.fetch(config.run, BUILTIN_MODEL, 0)
               if 0 in store.models.versions(config.run, BUILTIN_MODEL) else None)
    staging = store.models.staging(config.run, REWARD_MODEL, 0)
    train_tiny_judge(staging, examples, steps=settings.train_steps, seed=config.seed,
                     template=settings.judge_template, yes=settings.judge_yes, no=settings.judge_no,
                     max_length=settings.max_length, tokenizer_dir=builtin, threads=threads)
    store.models.commit(staging, config.run, REWARD_MODEL, 0)


def train_tiny_judge(directory: Path, examples: list[tuple[str, str, float]], *, steps: int, seed: int,
                     template: str = "{prompt}{response}\nIs that right? Answer:", yes: str = " yes", no: str = " no",
                     max_length: int = 256, batch_size: int = 32, lr: float = 3e-4, tokenizer_dir: Path | None = None,
                     threads: int | None = None) -> list[float]:
    """Build the built-in judge in ``directory`` and teach it on (prompt, response, label in [0, 1]): after
    ``template`` filled with the pair, the next token is ``yes`` for a good pair and ``no`` for a bad one. Each
    step is the mean cross-entropy of a batch's verdicts; returns the step losses."""
    from transformers import AutoTokenizer

    if not examples:
        raise ValueError("no reward examples to train the built-in reward model on")
    texts = [template.format(prompt=p, response=r) for p, r, _ in examples]
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir) if tokenizer_dir else train_tokenizer(texts)
    # The server reads each verdict's one next-token probability: a verdict the vocabulary splits becomes a token
    tokenizer.add_tokens([word for word in (yes, no) if len(tokenizer(word, add_special_tokens=False).input_ids) > 1])
    build_tiny_model(directory, texts, seed, tokenizer=tokenizer)
    # The rate decays linearly to a tenth over the steps (RewardModelConfig.train_steps says what a constant one did)
    trainer = warmup_trainer(str(directory), lr=lr, seed=seed, num_threads=threads, lr_decay_steps=steps)
    tokenizer = trainer.tokenizer
    tokenizer.truncation_side = "left"  # as the server reads a long text: its end, the response
    prompts = tokenizer(texts, add_special_tokens=False, truncation=True, max_length=max_length)["input_ids"]
    verdicts = [tokenizer(word, add_special_tokens=False)["input_ids"] for word in (no, yes)]
    labels = np.array([label for *_, label in examples], dtype=float)
    rng = np.random.default_rng(seed)
    losses = []
    for _ in range(steps):
        rows = rng.integers(0, len(texts), size=batch_size)
        # A label is the chance its row is taught yes: a soft label's cross-entropy in expectation, a hard one's exactly
        said_yes = rng.random(batch_size) < labels[rows]
        stats = trainer.accumulate_supervised(SupervisedBatch([prompts[i] for i in rows],
                                                              [verdicts[int(y)] for y in said_yes],
                                                              ["teach"] * batch_size))
        trainer.apply_step()
        losses.append(stats["loss_sum"] / stats["tokens"])
    save_policy(trainer.model, tokenizer, directory)
    return losses
