"""Partitions: the stage assets' micro-batches, the evaluated policy versions, and ``policies``' agents.

A stage partition is one micro-batch of one step of one run, keyed ``<run>-<step>-<micro_batch>``
(``demo-0007-02``) in one dynamic partitions definition. Its keys are added when a launch plans its steps
(``add_planned_stage_partitions``), so the UI lists exactly the micro-batches a run made or will make.
A step x micro-batch ``MultiPartitionsDefinition`` cannot: its keys are every pair of the two dimensions, so a
static micro-batch dimension of 16 listed 12 micro-batches per step that a 4-micro-batch run never makes, and
runs with different ``micro_batches_per_step`` (or the evaluations' extra version key) would still cross into
pairs no run planned. Run names hold no ``-`` (config pattern), so a key splits unambiguously from the right.
"""

from __future__ import annotations

import dagster as dg

# Keyed <run>-<version>: the policy versions a launch evaluates (the `evaluations` asset). The name predates
# the stage partitions' own definition and is kept so that existing instances keep their keys.
STEPS = dg.DynamicPartitionsDefinition(name="marl_steps")
AGENTS = dg.DynamicPartitionsDefinition(name="marl_agents")
RUNS = dg.DynamicPartitionsDefinition(name="marl_runs")  # keyed by run name: the `training_runs` asset
STAGE_PARTITIONS = dg.DynamicPartitionsDefinition(name="marl_stage_partitions")


def step_key(run: str, step: int) -> str:
    return f"{run}-{step:04d}"


def agent_key(run: str, agent: str) -> str:
    return f"{run}-{agent}"


def stage_partition(run: str, step: int, micro_batch: int) -> str:
    # Zero-padded so that keys sort as (step, micro-batch) in the UI's lists and searches.
    return f"{step_key(run, step)}-{micro_batch:02d}"


def planned_stage_partitions(run: str, first_step: int, last_step: int, micro_batches: int) -> list[str]:
    """The stage partition keys of steps first_step..last_step, each with micro-batches 0..micro_batches-1."""
    return [stage_partition(run, step, micro_batch)
            for step in range(first_step, last_step + 1) for micro_batch in range(micro_batches)]


def add_planned_stage_partitions(instance: dg.DagsterInstance, run: str, first_step: int, last_step: int,
                                 micro_batches: int) -> list[str]:
    """Register a launch's planned stage partitions (keys already there are kept); returns the keys."""
    keys = planned_stage_partitions(run, first_step, last_step, micro_batches)
    instance.add_dynamic_partitions(STAGE_PARTITIONS.name, keys)
    return keys


def parse_stage_partition(partition_key: str) -> tuple[str, int, int]:
    """(run, step, micro_batch) of a ``<run>-<step>-<micro_batch>`` key."""
    run, _, rest = str(partition_key).rpartition("-")
    run, _, step = run.rpartition("-")
    if not run or not step.isdigit() or not rest.isdigit():
        raise ValueError(f"stage partition {partition_key!r} is not of the form <run>-<step>-<micro_batch>")
    return run, int(step), int(rest)
