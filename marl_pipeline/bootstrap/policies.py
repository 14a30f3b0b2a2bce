"""Base policies (version 0 of every agent) and the lineage of later versions in the store."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from marl_pipeline.bootstrap.model_sources import resolve_model_source
from marl_pipeline.bootstrap.own_replies import policy_replies
from marl_pipeline.bootstrap.tiny_model import BUILTIN_MODEL, build_tiny_model
from marl_pipeline.bootstrap.warmup import supervised_warmup
from marl_pipeline.config import BUILTIN_TINY, AgentConfig, ExperimentConfig
from marl_pipeline.environment import Environment
from marl_pipeline.hooks import hooks_of, taught_own_turns
from marl_pipeline.policy.checkpoint import load_policy, save_policy
from marl_pipeline.policy.lora import WARMUP_ADAPTER, with_adapters
from marl_pipeline.policy.precision import resolve_dtype
from marl_pipeline.store import ExperienceStore


@dataclass(frozen=True)
class BasePolicy:
    """Version 0 of one agent's policy, as committed to the store."""

    agent: str
    path: Path
    created: bool
    """False when it was already in the store (a retraining run continues the lineage)."""
    warmup_loss: tuple[float, float] | None = None
    """First and last warm-up loss, when it was created now."""


def prepare_base_policies(config: ExperimentConfig, env: Environment, store: ExperienceStore) -> list[BasePolicy]:
    """Make sure every agent has a committed version 0; build and warm up the ones that lack it."""
    policies = []
    for index, (agent, agent_config) in enumerate(config.agents.items()):
        if store.policy_versions(config.run, agent):
            policies.append(BasePolicy(agent, store.policy_dir(config.run, agent, 0), created=False))
            continue
        policies.append(_create_base_policy(config, env, store, agent, agent_config, seed=config.seed + index))
    return policies


def _create_base_policy(config: ExperimentConfig, env: Environment, store: ExperienceStore, agent: str,
                        agent_config: AgentConfig, seed: int) -> BasePolicy:
    import torch

    torch.manual_seed(seed)
    source = agent_config.model
    if source == BUILTIN_TINY:
        # Every agent of a run starts from the same built-in initial model (its own copy is then trained),
        # committed in the store like a policy: durable in the bucket of an S3 store.
        if 0 not in store.models.versions(config.run, BUILTIN_MODEL):
            corpus = env.text_corpus(np.random.default_rng(config.seed), 4000)
            staging = store.models.staging(config.run, BUILTIN_MODEL, 0)
            build_tiny_model(staging, corpus, seed=config.seed)
            store.models.commit(staging, config.run, BUILTIN_MODEL, 0)
        source = str(store.models.fetch(config.run, BUILTIN_MODEL, 0))
    model, tokenizer = load_policy(resolve_model_source(source))
    staging = store.staging_policy_dir(config.run, agent, 0)
    warmup_loss = None
    if agent_config.warmup.separate and not taught_own_turns(env, agent):
        raise ValueError(f"agent {agent!r} has warmup.separate, but environment {env.name!r} names none of its "
                         f"turns as taught (its taught_turns hook): its warm-up's adapters would never be used")
    if agent_config.warmup.steps:
        warmup, algorithm = agent_config.warmup, config.algorithm
        rng, examples = np.random.default_rng(seed), None
        if hooks_of(env).own_reply_warmup_examples is not None:
            replies = functools.partial(policy_replies, model, tokenizer, source=f"agent {agent!r}",
                                        max_new_tokens=algorithm.max_new_tokens, temperature=algorithm.temperature)
            examples = env.own_reply_warmup_examples(agent, rng, warmup.steps * warmup.batch_size, replies)
        if examples is None:
            examples = env.warmup_examples(agent, rng, 4000)
        if warmup.lora is not None:  # adapters trained, then merged: version 0 stays a plain model
            model = with_adapters(model, **warmup.lora.model_dump())
        losses = supervised_warmup(model, tokenizer, examples, steps=warmup.steps, batch_size=warmup.batch_size,
                                   lr=warmup.lr, seed=seed, source=f"agent {agent!r}",
                                   max_new_tokens=algorithm.max_new_tokens, temperature=algorithm.temperature,
                                   dtype=resolve_dtype(agent_config.trainer.dtype, "cpu"),
                                   chunk_tokens=agent_config.trainer.chunk_tokens,
                                   rehearse_context=warmup.rehearse_context)
        warmup_loss = (losses[0], losses[-1])
        if warmup.separate:
            model.save_pretrained(str(staging / WARMUP_ADAPTER))  # apart, frozen (policy/lora.py)
            model = model.unload()  # the model as loaded: the adapters never touched its weights
        elif warmup.lora is not None:
            model = model.merge_and_unload()
    save_policy(model, tokenizer, staging)  # save_pretrained carries the source's generation_config along
    path = store.commit_policy(staging, config.run, agent, 0)
    return BasePolicy(agent, path, created=True, warmup_loss=warmup_loss)


def latest_versions(store: ExperienceStore, run: str, agents: list[str]) -> dict[str, int]:
    """The newest committed policy version of each agent (0 if only the base exists)."""
    return {agent: max(store.policy_versions(run, agent), default=0) for agent in agents}
