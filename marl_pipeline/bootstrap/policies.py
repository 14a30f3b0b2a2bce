"""Base policies (version 0 of every agent) and the lineage of later versions in the store."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from marl_pipeline.bootstrap.model_sources import resolve_model_source
from marl_pipeline.bootstrap.own_replies import policy_replies
from marl_pipeline.bootstrap.tiny_model import BUILTIN_MODEL, build_tiny_model
from marl_pipeline.bootstrap.warmup import supervised_warmup, warmup_trainer
from marl_pipeline.config import BUILTIN_TINY, AgentConfig, ExperimentConfig, StoreConfig
from marl_pipeline.environment import Environment
from marl_pipeline.hooks import hooks_of
from marl_pipeline.policy.checkpoint import load_policy, save_policy
from marl_pipeline.policy.lora import NAMED_ADAPTERS, named_adapter_dirs
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


def prepare_base_policies(config: ExperimentConfig, env: Environment, store: ExperienceStore,
                          on_ray: bool = False) -> list[BasePolicy]:
    """Make sure every agent has a committed version 0; build and warm up the ones that lack it.

    With ``on_ray`` (the ``base_policies`` asset) each missing version 0 is prepared in a Ray task with the agent's
    trainer resources, all at once, each using its share of the cluster's cores; in-process otherwise (tests,
    scripts without Ray). A launch prepares them in the agents' trainer actors instead (cluster/spawn.py), through
    :func:`base_policy_makers`. The built-in model they start from is built first, once."""
    existing = {agent: BasePolicy(agent, store.policy_dir(config.run, agent, 0), created=False)
                for agent in config.agents if store.policy_versions(config.run, agent)}
    makers = base_policy_makers(config, env, store)
    trainers = {agent: config.agents[agent].trainer for agent in makers}
    options = {agent: dict(num_cpus=trainer.num_cpus, num_gpus=trainer.num_gpus,
                           resources=dict(config.ray.trainer_resources)) for agent, trainer in trainers.items()}
    created = make_on_ray(makers, options) if on_ray else [make() for make in makers.values()]
    created_by_agent = {policy.agent: policy for policy in created}
    policies = [existing.get(agent) or created_by_agent[agent] for agent in config.agents]
    require_turn_adapters(config, store)
    return policies


def make_on_ray(makers: dict[str, Callable[..., BasePolicy]], options: dict[str, dict]) -> list[BasePolicy]:
    """Run ``makers`` in Ray tasks, each with its agent's ``options`` (a trainer's resources), all at once, each with
    its share of the cluster's cores."""
    import ray

    threads = max(1, int(ray.cluster_resources().get("CPU", 1)) // max(len(makers), 1))
    task = ray.remote(_make)  # a partial is not a function to ray.remote
    return ray.get([task.options(**options[agent]).remote(make, threads) for agent, make in makers.items()])


def _make(make: Callable[..., BasePolicy], threads: int) -> BasePolicy:
    return make(threads)


def base_policy_makers(config: ExperimentConfig, env: Environment,
                       store: ExperienceStore) -> dict[str, Callable[..., BasePolicy]]:
    """For each agent without a version 0 in the store, a picklable call ``make(threads=None)`` that builds, warms
    up and commits it wherever it runs (a trainer actor, a Ray task, this process). The built-in model the agents
    on ``builtin:tiny`` start from is built here first, once, as every maker reads it."""
    missing = {agent: (agent_config, config.agent_slice(agent).seed) for agent, agent_config in config.agents.items()
               if not store.policy_versions(config.run, agent)}
    if any(agent_config.model == BUILTIN_TINY for agent_config, _ in missing.values()):
        ensure_builtin_model(config, env, store.config)
    return {agent: functools.partial(_create_base_policy, config, env, store.config, agent, agent_config, seed)
            for agent, (agent_config, seed) in missing.items()}


def require_turn_adapters(config: ExperimentConfig, store: ExperienceStore) -> None:
    """Refuse an agent whose ``turn_adapters`` name an adapter its version 0 does not hold."""
    for agent, agent_config in config.agents.items():
        if not agent_config.turn_adapters:
            continue
        path = store.require_policy(config.run, agent, 0)
        held = named_adapter_dirs(path)
        missing = sorted(set(agent_config.turn_adapters) - set(held))
        if missing:
            raise ValueError(f"agent {agent!r}: turn_adapters names {missing}, but its version 0 ({path}) holds "
                             f"{sorted(held) or 'no named adapters'} (a warm-up writes one with warmup.adapter)")


def ensure_builtin_model(config: ExperimentConfig, env: Environment, store_config: StoreConfig) -> Path:
    """The run's built-in initial model (every agent on ``builtin:tiny`` starts from it, its own copy then trained),
    built from the plugin's text on first use and committed in the store like a policy: durable in the bucket of an
    S3 store."""
    store = ExperienceStore(store_config)
    if 0 not in store.models.versions(config.run, BUILTIN_MODEL):
        corpus = env.text_corpus(np.random.default_rng(config.seed), 4000)
        staging = store.models.staging(config.run, BUILTIN_MODEL, 0)
        build_tiny_model(staging, corpus, seed=config.seed)
        store.models.commit(staging, config.run, BUILTIN_MODEL, 0)
    return store.models.fetch(config.run, BUILTIN_MODEL, 0)


def _create_base_policy(config: ExperimentConfig, env: Environment, store_config: StoreConfig, agent: str,
                        agent_config: AgentConfig, seed: int, threads: int | None = None) -> BasePolicy:
    """One agent's version 0: its model (the run's built-in one for ``builtin:tiny``), warmed up, committed; or,
    where it is already committed (a maker called again), that one."""
    import torch

    store = ExperienceStore(store_config)
    if store.policy_versions(config.run, agent):
        return BasePolicy(agent, store.policy_dir(config.run, agent, 0), created=False)
    if threads is not None:
        torch.set_num_threads(threads)
    torch.manual_seed(seed)
    source = agent_config.model
    if source == BUILTIN_TINY:
        source = str(store.models.fetch(config.run, BUILTIN_MODEL, 0))
    source = str(resolve_model_source(source))
    staging = store.staging_policy_dir(config.run, agent, 0)
    warmup, warmup_loss = agent_config.warmup, None
    if not warmup.steps:
        model, tokenizer = load_policy(source)
    else:
        algorithm = config.algorithm_of(agent)
        trainer = warmup_trainer(source, lr=warmup.lr, seed=seed,
                                 lora=None if warmup.lora is None else warmup.lora.model_dump(),
                                 dtype=agent_config.trainer.dtype, chunk_tokens=agent_config.trainer.chunk_tokens,
                                 activation_checkpointing=agent_config.trainer.activation_checkpointing)
        model, tokenizer = trainer.model, trainer.tokenizer
        rng, examples = np.random.default_rng(seed), []
        replies = functools.partial(policy_replies, model, tokenizer, source=f"agent {agent!r}",
                                    max_new_tokens=algorithm.max_new_tokens, temperature=algorithm.temperature)
        for role in config.roles_played(agent):  # each role's examples (one role unless the policy is shared)
            role_examples = None
            if hooks_of(env).own_reply_warmup_examples is not None:
                role_examples = env.own_reply_warmup_examples(role, rng, warmup.steps * warmup.batch_size, replies)
            examples += env.warmup_examples(role, rng, 4000) if role_examples is None else role_examples
        losses = supervised_warmup(trainer, examples, steps=warmup.steps, batch_size=warmup.batch_size, seed=seed,
                                   source=f"agent {agent!r}", max_new_tokens=algorithm.max_new_tokens,
                                   temperature=algorithm.temperature)
        warmup_loss = (losses[0], losses[-1])
        del trainer  # its AdamW moments and start copy, before the model is saved
        if warmup.adapter:
            model.save_pretrained(str(staging / NAMED_ADAPTERS / warmup.adapter))  # apart, frozen (policy/lora.py)
            model = model.unload()  # the model as loaded: the adapters never touched its weights
        elif warmup.lora is not None:  # adapters trained, then merged: version 0 stays a plain model
            model = model.merge_and_unload()
    save_policy(model, tokenizer, staging)  # save_pretrained carries the source's generation_config along
    path = store.commit_policy(staging, config.run, agent, 0)
    return BasePolicy(agent, path, created=True, warmup_loss=warmup_loss)


def latest_versions(store: ExperienceStore, run: str, agents: list[str]) -> dict[str, int]:
    """The newest committed policy version of each agent (0 if only the base exists)."""
    return {agent: max(store.policy_versions(run, agent), default=0) for agent in agents}
