"""What a trainer consumes and returns: RL micro-batches, supervised batches, step results; and how a batch's rows
are cut into passes."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TrainBatch:
    """One agent's shard of one micro-batch: built by the train stage from the store, consumed here."""

    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    old_logprobs: list[list[float]]
    advantages: list[float]
    dropped_rows: int = 0
    """Rows the stage left out as uninformative (zero-advantage groups); reported, not trained on."""
    adapters: list[str | None] | None = None
    """Per row, the named adapter that served its turn (the rollout row's ``adapter``): computed with it active too,
    as the engine sampled it (policy/lora.py). None: no such rows."""


SUPERVISED_TERMS = ("teach", "keep", "keep_path")
"""What a supervised row's response is trained to: ``teach`` its tokens (cross-entropy); ``keep`` the reference
model's distribution at its positions (KL from the reference over the vocabulary); ``keep_path`` that and its own
tokens' log-probabilities where the reference has them (a squared difference), which the KL barely holds for a
token the reference rarely samples."""


@dataclass(frozen=True)
class SupervisedBatch:
    """Supervised rows (the warm-up's, bootstrap/warmup.py): trained by the same passes, precision, device and
    step as RL's, with a per-row term instead of an advantage."""

    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    terms: list[str]
    """Per row, one of :data:`SUPERVISED_TERMS`."""


@dataclass(frozen=True)
class StepResult:
    """One optimizer step of one agent: produced by :meth:`PolicyTrainer.apply_step`, consumed by the
    orchestrator's publisher (stored in the version's ``timing.json``)."""

    policy_version: int
    """The version the step produced."""
    tokens: int
    """Response tokens of the step."""
    sequences: int
    """Sequences of the step with at least one response token."""
    grad_norm: float
    """Gradient norm before clipping."""
    lr: float
    """Learning rate of the step."""
    computed_tokens: int = 0
    """Real tokens (prompts and responses, no padding) the step's passes computed, over every worker."""
    # Measurements, left out of equality: two steps that computed the same differ in them
    compute_seconds: float = field(default=0.0, compare=False)
    """The trainer's own time in the step's passes and optimizer step (one worker's: they compute side by side)."""
    tokens_per_second: float = field(default=0.0, compare=False)
    """``computed_tokens / compute_seconds``."""
    mfu: float = field(default=0.0, compare=False)
    """Model FLOPs utilization: 6 x parameters x ``computed_tokens`` / ``compute_seconds`` over the workers'
    measured matmul peak (training/flops.py)."""
    peak_tflops: float = field(default=0.0, compare=False)
    """One worker's measured matmul peak in the trainer's precision, TFLOP/s."""
    chunk_tokens: int = 0
    """Tokens a pass (the budget the trainer chose or was given)."""
    passes: str = ""
    """``packed`` (padding-free, attention per row) or ``padded`` (training/packing.py)."""
    swaps: int = field(default=0, compare=False)
    """The trainer worker's swaps so far (in and out), where one serves several agents (0: a trainer of its own)."""
    swap_seconds: float = field(default=0.0, compare=False)
    """Their seconds so far: what its agents' steps spent changing the state it holds."""


def length_chunks(lengths: list[int], budget: int) -> list[list[int]]:
    """Row indices sorted by length and cut so that each chunk's rows x longest row stays within ``budget``
    (a row longer than the budget is a chunk of its own). Equal lengths keep their order."""
    chunks: list[list[int]] = []
    for row in sorted(range(len(lengths)), key=lengths.__getitem__):
        if chunks and (len(chunks[-1]) + 1) * lengths[row] <= budget:
            chunks[-1].append(row)
        else:
            chunks.append([row])
    return chunks


def rows_by_adapter(batch: TrainBatch) -> list[tuple[str | None, list[int]]]:
    """The batch's rows split by the named adapter they are computed with (None first), each part in row
    order."""
    rows = range(len(batch.prompt_ids))
    if not batch.adapters or not any(batch.adapters):
        return [(None, list(rows))]
    if len(batch.adapters) != len(batch.prompt_ids):
        raise ValueError(f"{len(batch.prompt_ids)} rows but {len(batch.adapters)} adapter names: one per row")
    names = sorted({name for name in batch.adapters if name})
    parts = [(name, [row for row in rows if batch.adapters[row] == name]) for name in [None, *names]]
    return [(name, part) for name, part in parts if part]
