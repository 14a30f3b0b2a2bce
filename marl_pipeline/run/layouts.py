"""EARL's runtime half: an agent's layout (its engine replicas' tensor parallelism, its trainer's workers) follows the
context length its turns reach, from ``agents.<a>.parallelism_by_length`` (``marl plan --by-length`` prints the
ranges). The layout is a function of the stored rollouts of the step before, so a launch starting or resuming at
step s reads it from step s - 1's rollouts, and the orchestrator, which sees each step's rollouts as they commit,
ends its launch after a step whose lengths call for another layout; ``recipe.train`` then starts the next launch
with it (kept actors restarted in place, the rest new) through the same resume path a killed launch takes, so a
change is exactly-once as any restart is."""

from __future__ import annotations

from collections.abc import Callable

import pyarrow as pa
import pyarrow.compute as pc

from marl_pipeline.config import ExperimentConfig
from marl_pipeline.store import ExperienceStore, MicroBatchKey

COLUMNS = ["agent", "prompt_ids", "response_ids"]


def longest_turns(table: pa.Table) -> dict[str, int]:
    """Per agent, the longest prompt + response of its turns in ``table`` (rollouts): the context a replica holds and
    a trainer's pass takes for one row."""
    lengths = pc.add(pc.list_value_length(table["prompt_ids"]), pc.list_value_length(table["response_ids"]))
    grouped = pa.table({"agent": table["agent"], "tokens": lengths}).group_by("agent").aggregate([("tokens", "max")])
    return dict(zip(grouped["agent"].to_pylist(), grouped["tokens_max"].to_pylist(), strict=True))


def wanted_layouts(config: ExperimentConfig, lengths: dict[str, int]) -> dict[str, int | None]:
    """Each agent with ``parallelism_by_length`` (and turns in ``lengths``): its entry for the next step."""
    return {name: agent.layout_at(lengths[name]) for name, agent in config.agents.items()
            if agent.parallelism_by_length and name in lengths}


def _layouts_after(config: ExperimentConfig, read: Callable[..., pa.Table],
                   keys: list[MicroBatchKey]) -> tuple[dict[str, int | None], dict[str, int]]:
    """The entries the rollouts of ``keys`` (read by ``read``) call for, and every agent's longest turn in them."""
    lengths = longest_turns(pa.concat_tables(read("rollouts", key, columns=COLUMNS) for key in keys))
    return wanted_layouts(config, lengths), lengths


def changed_layouts(config: ExperimentConfig, layouts: dict[str, int | None], read: Callable[..., pa.Table],
                    keys: list[MicroBatchKey]) -> tuple[dict[str, int | None], dict[str, int]]:
    """The agents whose layout after the step of ``keys`` (its rollouts, by ``read``) differs from ``layouts``, with
    their new entries, and every agent's longest turn; nothing when no agent has ``parallelism_by_length``."""
    if not any(agent.parallelism_by_length for agent in config.agents.values()):
        return {}, {}
    wanted, lengths = _layouts_after(config, read, keys)
    return {agent: index for agent, index in wanted.items() if index != layouts.get(agent)}, lengths


def stored_layouts(store: ExperienceStore, config: ExperimentConfig, step: int) -> dict[str, int | None]:
    """The layouts after ``step`` (-1: before any step, as set), from its committed rollouts."""
    if step < 0 or not any(agent.parallelism_by_length for agent in config.agents.values()):
        return {}
    keys = [key for key in store.committed_keys(config.run, "rollouts") if key.step == step]
    if not keys:
        return {}  # no rollouts of it here (policies imported, or experience removed): as set
    return _layouts_after(config, store.read, keys)[0]


def describe(config: ExperimentConfig, agent: str, index: int | None) -> str:
    """``tensor parallel 2, 2 trainer workers`` for the agent's entry ``index`` (None: as set)."""
    laid = config.agents[agent].laid_out(index)
    workers = laid.trainer.workers
    return (f"tensor parallel {laid.engine.tensor_parallel_size}, {workers} trainer worker"
            f"{'s' if workers > 1 else ''}")
