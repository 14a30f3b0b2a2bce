"""Partitions of the stage assets: step x micro-batch, and of ``policies``: one per agent.

Step keys carry the run name (``demo-0007``) so that several runs can share one Dagster instance;
micro-batch keys are static (config caps ``micro_batches_per_step`` at 16).
"""

from __future__ import annotations

import dagster as dg

STEPS = dg.DynamicPartitionsDefinition(name="marl_steps")
AGENTS = dg.DynamicPartitionsDefinition(name="marl_agents")
MICRO_BATCHES = dg.StaticPartitionsDefinition([str(i) for i in range(16)])
STEP_X_MICRO_BATCH = dg.MultiPartitionsDefinition({"step": STEPS, "micro_batch": MICRO_BATCHES})


def step_key(run: str, step: int) -> str:
    return f"{run}-{step:04d}"


def agent_key(run: str, agent: str) -> str:
    return f"{run}-{agent}"


def stage_partition(run: str, step: int, micro_batch: int) -> dg.MultiPartitionKey:
    return dg.MultiPartitionKey({"step": step_key(run, step), "micro_batch": str(micro_batch)})


def parse_stage_partition(partition_key: str | dg.MultiPartitionKey) -> tuple[str, int, int]:
    """(run, step, micro_batch) of a stage partition key."""
    if not isinstance(partition_key, dg.MultiPartitionKey):
        partition_key = STEP_X_MICRO_BATCH.get_partition_key_from_str(partition_key)
    dimensions = partition_key.keys_by_dimension
    run, _, step = dimensions["step"].rpartition("-")
    if not run or not step.isdigit():
        raise ValueError(f"step partition {dimensions['step']!r} is not of the form <run>-<step>")
    return run, int(step), int(dimensions["micro_batch"])
