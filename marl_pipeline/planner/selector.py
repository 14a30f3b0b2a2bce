"""EARL's selector: per agent, the engine's tensor parallelism and the trainer's workers each range of context length
needs on a GPU, from the memory model, and the observed length at which the next parallelism becomes necessary.

An engine replica on ``t`` devices holds the weights split ``t`` ways and ``sequences`` sequences' KV cache at the
context length, the key/value heads split over at most ``kv_heads`` devices (vLLM replicates them beyond), within
``utilization`` of each device (vLLM's ``gpu_memory_utilization``). A trainer on ``w`` workers (FSDP) holds its
weights, gradients and AdamW moments split ``w`` ways (the output head's gradient whole) and one whole pass of at
least one row of that length (``training/memory.py``'s peak, which the trainer's own token budget uses) within
``memory.PASS_SHARE`` of a device. The smallest fitting parallelism is chosen: more devices per replica or trainer
only add communication while fewer fit (EARL, "batching and parallelism chosen by context length"). Throughput
beyond fitting is the simulation's to judge (``marl plan --search``).
"""

from __future__ import annotations

from dataclasses import dataclass

from marl_pipeline.planner.profiles import GpuSpec, ModelShape
from marl_pipeline.training.memory import PASS_SHARE, trainer_peak_bytes

CHOICES = (1, 2, 4, 8)
"""Tensor parallelism and trainer workers tried: the divisors of a node's 8 GPUs."""


@dataclass(frozen=True)
class Range:
    """Context lengths up to ``up_to`` tokens (from the previous range's end): what they need."""

    up_to: int
    tensor_parallel: int | None
    """The engine replica's devices (None: no choice fits)."""
    trainer_workers: int | None
    """The trainer's workers (None: no choice fits)."""


def engine_fits(shape: ModelShape, gpu: GpuSpec, tensor_parallel: int, context: int, sequences: int,
                utilization: float = 0.9, dtype_bytes: int = 2) -> bool:
    """Whether a replica on ``tensor_parallel`` devices holds its weights and ``sequences`` sequences at ``context``
    tokens of KV cache."""
    weights = shape.parameters * dtype_bytes / tensor_parallel
    cache = sequences * context * shape.kv_bytes_per_token(dtype_bytes) / min(tensor_parallel, shape.kv_heads)
    return weights + cache <= utilization * gpu.memory_gib * 2**30


def trainer_fits(config: dict, shape: ModelShape, gpu: GpuSpec, workers: int, context: int, *,
                 trainable: int | None = None, reference: bool = False) -> bool:
    """Whether a trainer on ``workers`` workers holds its sharded state and a pass of one ``context``-token row."""
    trainable = shape.parameters if trainable is None else trainable
    # FSDP shards what scales with the parameters (weights, AdamW moments, gradients), not a pass's activations
    peak = trainer_peak_bytes(config, parameters=-(-shape.parameters // workers), trainable=-(-trainable // workers),
                              tokens=context, reference=reference)
    return peak <= PASS_SHARE * gpu.memory_gib * 2**30


def smallest(fits, context: int) -> int | None:
    return next((choice for choice in CHOICES if fits(choice, context)), None)


def longest(fits, choice: int, limit: int) -> int:
    """The longest context up to ``limit`` at which ``choice`` still fits (0: not even one token)."""
    low, high = 0, limit
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if fits(choice, middle) else (low, middle - 1)
    return low


def parallelism_by_length(config: dict, gpu: GpuSpec, sequences: int, longest_context: int = 1 << 17, *,
                          trainable: int | None = None, reference: bool = False,
                          utilization: float = 0.9) -> list[Range]:
    """The ranges of context length (up to ``longest_context``) over which an agent's needs stay the same: for each,
    the smallest tensor parallelism that holds ``sequences`` sequences and the fewest trainer workers that hold a
    row, at the range's longest context. A range ends where the engine's or the trainer's choice must grow: the
    observed length at which the next parallelism is needed.

    Args:
        config: the agent's model ``config.json`` as a dict.
        gpu: the devices' stated figures.
        sequences: sequences an engine replica holds at once (its ``max_num_seqs``, or the episodes in flight).
    """
    shape = ModelShape.from_config(config)

    def engine(choice: int, context: int) -> bool:
        return engine_fits(shape, gpu, choice, context, sequences, utilization)

    def trainer(choice: int, context: int) -> bool:
        return trainer_fits(config, shape, gpu, choice, context, trainable=trainable, reference=reference)

    ends = {longest_context}
    for fits in (engine, trainer):
        for choice in CHOICES:
            end = longest(fits, choice, longest_context)
            if 0 < end < longest_context:
                ends.add(end)
    ranges: list[Range] = []
    for end in sorted(ends):
        current = Range(end, smallest(engine, end), smallest(trainer, end))
        if ranges and (ranges[-1].tensor_parallel, ranges[-1].trainer_workers) == (
                current.tensor_parallel, current.trainer_workers):
            ranges[-1] = current  # the same needs: one range
        else:
            ranges.append(current)
    return ranges


def describe(ranges: list[Range]) -> list[str]:
    """One line a range: ``up to 12,345 tokens: tensor parallel 2, 1 trainer worker``."""
    lines, start = [], 1
    for entry in ranges:
        engine = "no tensor parallelism fits" if entry.tensor_parallel is None else (
            f"tensor parallel {entry.tensor_parallel}")
        trainer = "no trainer workers fit" if entry.trainer_workers is None else (
            f"{entry.trainer_workers} trainer worker{'s' if entry.trainer_workers > 1 else ''}")
        lines.append(f"{start:,}-{entry.up_to:,} tokens: {engine}, {trainer}")
        start = entry.up_to + 1
    return lines


def layout_entries(ranges: list[Range]) -> list[dict]:
    """The ranges as ``agents.<a>.parallelism_by_length`` entries a run applies between steps (run/layouts.py): one
    from each range's first length on, the first from 0; a range where nothing fits ends them."""
    entries, start = [], 0
    for entry in ranges:
        if entry.tensor_parallel is None or entry.trainer_workers is None:
            break
        entries.append({"from_tokens": start, "tensor_parallel_size": entry.tensor_parallel,
                        "trainer_workers": entry.trainer_workers})
        start = entry.up_to + 1
    return entries
