"""Train stage: each agent's trainer accumulates the gradient of its own shard of a micro-batch.

A trainer receives only its agent's rows: the stage reads that agent's rollout and reward files
(partition pruning by directory, column projection) and joins them on ``sample_id``.

Dynamic sampling (an agent's ``algorithm.drop_zero_advantage_groups``, DAPO's filter without its re-sampling): a group
whose episodes all earned the agent the same reward has zero advantage everywhere, so its rows add nothing to
the policy gradient but still count in the step's token (or sequence) total and dilute the others'. Dropped,
the step's gradient is the informative groups' alone. The filter is per agent: a group can teach the solver
and not the verifier.
"""

from __future__ import annotations

from collections.abc import Container

import pyarrow as pa
import pyarrow.compute as pc
import ray

from marl_pipeline.stages.episodes import kept_turns
from marl_pipeline.store import ExperienceStore, MicroBatchKey
from marl_pipeline.store.recent import RecentCommits
from marl_pipeline.store.schema import POLICY_UPDATES, with_agent
from marl_pipeline.training.batches import TrainBatch


def train_batch_for(store: ExperienceStore | RecentCommits, key: MicroBatchKey, agent: str,
                    drop_zero_advantage_groups: bool = False) -> TrainBatch:
    """One agent's shard of a micro-batch, in ``sample_id`` order (so recomputations sum in the same order)."""
    rollouts = kept_turns(store.read("rollouts", key, agent=agent, columns=[  # over-sampling's dropped: no reward
        "sample_id", "adapter", "prompt_ids", "response_ids", "logprobs", "status"])).drop_columns(["status"])
    rewards = store.read("rewards", key, agent=agent, columns=["sample_id", "group_id", "advantage", "status"])
    # Arrow joins do not carry list columns: align the reward rows to the rollout rows by index instead.
    position = pc.index_in(rollouts.column("sample_id"), value_set=rewards.column("sample_id"))
    if position.null_count:
        raise ValueError(f"{key} agent {agent}: {position.null_count} rollout turns have no reward row")
    joined = rollouts.append_column("advantage", rewards.column("advantage").take(position))
    joined = joined.append_column("status", rewards.column("status").take(position))
    joined = joined.append_column("group_id", rewards.column("group_id").take(position))
    joined = joined.filter(pc.field("status") == "ok").sort_by("sample_id")
    dropped = 0
    if drop_zero_advantage_groups:
        kept = joined.filter(pc.is_in(joined.column("group_id"), value_set=informative_groups(joined)))
        dropped, joined = joined.num_rows - kept.num_rows, kept
    return TrainBatch(
        prompt_ids=joined.column("prompt_ids").to_pylist(),
        response_ids=joined.column("response_ids").to_pylist(),
        old_logprobs=joined.column("logprobs").to_pylist(),
        advantages=joined.column("advantage").to_pylist(),
        dropped_rows=dropped,
        adapters=adapters.to_pylist() if (adapters := joined.column("adapter")).null_count < len(adapters) else None,
    )


def informative_groups(rows: pa.Table) -> pa.Array:
    """The ``group_id`` values of ``rows`` with at least one non-zero advantage."""
    spread = rows.group_by("group_id").aggregate([("advantage", "min"), ("advantage", "max")])
    nonzero = pc.or_(pc.not_equal(spread.column("advantage_min"), 0), pc.not_equal(spread.column("advantage_max"), 0))
    return spread.column("group_id").filter(nonzero)


def issue_order(agents: list[str], micro_batch: int) -> list[str]:
    """The order a micro-batch's accumulate calls are issued in: reversed on odd micro-batches.

    For resident trainers the order does not matter (they run in parallel). A trainer worker serving several
    swapped agents (``training/swap.py``) runs their calls in the order issued and swaps on each change of agent;
    in alternating order the agent it ends one micro-batch with starts the next, one swap less per worker and
    micro-batch (half of them with two agents per worker)."""
    return list(reversed(agents)) if micro_batch % 2 else list(agents)


def train_micro_batch(store: ExperienceStore | RecentCommits, key: MicroBatchKey,
                      trainers: dict[str, ray.actor.ActorHandle], dropping: Container[str] = ()) -> pa.Table:
    """Accumulate every agent's gradient for one micro-batch (in parallel); one stats row per agent. ``dropping``:
    the agents that leave out their zero-advantage groups (``ExperimentConfig.dropping_zero_advantage_groups``)."""
    refs = {agent: trainers[agent].accumulate.remote(train_batch_for(store, key, agent, agent in dropping))
            for agent in issue_order(list(trainers), key.micro_batch)}
    stats = dict(zip(refs, ray.get(list(refs.values()))))
    return updates_table({agent: stats[agent] for agent in trainers})  # rows in the agents' order, as before


def updates_table(stats_by_agent: dict[str, dict]) -> pa.Table:
    """The ``policy_updates`` rows of one micro-batch from each agent's ``PolicyTrainer.accumulate`` stats."""
    rows = [{**{name: stats.get(name) for name in POLICY_UPDATES.names}, "status": "ok", "agent": agent}
            for agent, stats in stats_by_agent.items()]
    return pa.Table.from_pylist(rows, schema=with_agent(POLICY_UPDATES))
