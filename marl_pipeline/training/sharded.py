"""The torch side of an agent's trainer on several workers (``trainer.workers``): FSDP2 (``fully_shard``) shards the
weights, gradients and AdamW state over torch.distributed ranks, gloo on CPU and NCCL on GPUs.

Every rank computes the gradient of its share of a micro-batch's rows; FSDP reduce-scatters them summed (not
averaged: the step divides by the token count over all ranks), so N workers take one worker's step. FSDP's
collectives run once per forward/backward pass, so every rank runs the same number of passes: a rank with fewer
runs idle ones. Checkpoints are gathered: rank 0 holds the full weights and AdamW state in the one-worker format,
so a version resumes on any number of workers. The Ray side (placement, rank 0 leading) is cluster/trainers.py.

FSDP2 and the state-dict helpers are imported where they are used: ``torch.distributed.tensor`` is a slow import,
which every trainer, engine and driver would otherwise pay at start-up, sharded or not.
"""

from __future__ import annotations

import datetime
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from marl_pipeline.training.losses import TokenTerms, scored_token_terms

COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)
"""A rank that waits this long for the others fails (a dead worker), rather than hanging the run."""


@dataclass(frozen=True)
class Rank:
    """One worker's place in its agent's trainer."""

    rank: int
    world: int
    address: str
    """``host:port`` where rank 0 meets the others (torch's TCP rendezvous)."""


def join(rank: Rank, device: torch.device) -> None:
    """Join the agent's process group: gloo for CPU tensors, and NCCL for CUDA ones on a GPU."""
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":  # Ray shows each worker its own GPU(s): the first is its rank's
        torch.cuda.set_device(device.index or 0)
    dist.init_process_group(backend, init_method=f"tcp://{rank.address}", rank=rank.rank, world_size=rank.world,
                            timeout=COLLECTIVE_TIMEOUT)


def leave() -> None:
    """Leave the agent's process group, for a rank rebuilt in its process to join a new one."""
    if dist.is_initialized():
        dist.destroy_process_group()


class ShardedScorer(torch.nn.Module):
    """The policy's token terms (:func:`scored_token_terms`) as a module, so that FSDP's root gathers the embeddings,
    final norm and output head around them: the terms call the decoder and the head apart, which FSDP's hooks on the
    causal LM's own ``forward`` would miss."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.policy = model

    def forward(self, input_ids, attention_mask, positions, entropy: bool = False, start=None,
                packing: dict | None = None) -> tuple:
        terms = scored_token_terms(self.policy, input_ids, attention_mask, positions, entropy=entropy, start=start,
                                   packing=packing)
        # Tensors, so that FSDP hooks their backward; copies, not views of one (a view's hook an in-place op drops)
        return tuple(None if t is None else t.clone()
                     for t in (terms.logprobs, terms.entropy, terms.start_logprobs, terms.start_kl))

    def terms(self, *args, **kwargs) -> TokenTerms:
        return TokenTerms(*self(*args, **kwargs))


def shard(model: torch.nn.Module) -> ShardedScorer:
    """Shard ``model`` in place over the process group: each decoder layer one FSDP unit, the rest the root's."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    for layer in model.get_decoder().layers:
        fully_shard(layer)
    scorer = fully_shard(ShardedScorer(model))
    for module in scorer.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)  # summed over ranks: the step divides by the global count
            module.set_force_sum_reduction_for_comms(True)  # a plain SUM: gloo has no PREMUL_SUM (float32's op)
    return scorer


def passes_short(passes: int) -> int:
    """How many passes fewer than the busiest rank this rank's ``passes`` are (all ranks ask before any pass)."""
    most = torch.tensor([passes])
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    return int(most) - passes


def idle_pass(scorer: ShardedScorer, pad_id: int, device: torch.device) -> None:
    """A pass with no loss (one token), for FSDP's collectives: a rank with fewer passes than another runs these."""
    ids = torch.full((1, 2), pad_id, device=device)
    logprobs = scorer.terms(ids, torch.ones_like(ids), torch.ones((1, 1), dtype=torch.bool, device=device)).logprobs
    (logprobs.sum() * 0).backward()


def summed(*counts: int) -> list[int]:
    """Integers summed over the ranks."""
    total = torch.tensor(counts, dtype=torch.int64)
    dist.all_reduce(total)
    return total.tolist()


def full_norm(norm: torch.Tensor) -> torch.Tensor:
    """A gradient norm over sharded parameters, as one tensor."""
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # a DTensor's


def deal(lengths: list[int], world: int) -> list[list[int]]:
    """Rows for each rank, longest first to the rank with the fewest tokens so far; each rank's rows in order."""
    shares: list[list[int]] = [[] for _ in range(world)]
    tokens = [0] * world
    for row in sorted(range(len(lengths)), key=lambda r: -lengths[r]):
        rank = tokens.index(min(tokens))
        shares[rank].append(row)
        tokens[rank] += lengths[row]
    return [sorted(share) for share in shares]


def merged_stats(stats: list[dict[str, float]]) -> dict[str, float]:
    """The ranks' micro-batch statistics as one trainer's over all the rows: counts summed, per-token means weighted
    by tokens, the ratio's standard deviation pooled, the slowest rank's compute time."""
    tokens = sum(s["tokens"] for s in stats)
    weights = [s["tokens"] / tokens if tokens else 1 / len(stats) for s in stats]
    merged = {key: sum(s[key] for s in stats) for key in ("rows", "tokens", "loss_sum", "dropped_rows")}
    merged["compute_seconds"] = max(s["compute_seconds"] for s in stats)  # the ranks compute side by side
    for key in ("clip_fraction", "mean_ratio", "mismatch_abs_logprob"):
        merged[key] = sum(w * s[key] for w, s in zip(weights, stats))
    merged["mismatch_ratio_std"] = math.sqrt(sum(
        w * (s["mismatch_ratio_std"] ** 2 + (s["mean_ratio"] - merged["mean_ratio"]) ** 2)
        for w, s in zip(weights, stats)))
    return {**stats[0], **merged}


def gathered_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The full weights in Hugging Face naming on rank 0's CPU (every rank calls it; the others get {})."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model, options=_gathered())


def gathered_optimizer_state(scorer: ShardedScorer, optimizer: torch.optim.Optimizer) -> dict:
    """AdamW's full state on rank 0, in the one-worker format (``optimizer.state_dict()``: parameters by index, in
    the optimizer's order); every rank calls it, the others get {}."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    state = get_optimizer_state_dict(scorer, optimizer, options=_gathered())
    if not state:
        return {}
    names = [name for group in state["param_groups"] for name in group["params"]]
    index = {name: position for position, name in enumerate(names)}
    return {"state": {index[name]: value for name, value in state["state"].items()},
            "param_groups": [{**group, "params": [index[name] for name in group["params"]]}
                             for group in state["param_groups"]]}


def load_optimizer_state(scorer: ShardedScorer, optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Give every rank its shard of a one-worker AdamW state (each rank read the whole file)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    names = {id(param): name for name, param in scorer.named_parameters()}
    order = [names[id(param)] for group in optimizer.param_groups for param in group["params"]]
    by_name = {"state": {order[index]: value for index, value in state["state"].items()},
               "param_groups": [{**group, "params": [order[index] for index in group["params"]]}
                                for group in state["param_groups"]]}
    set_optimizer_state_dict(scorer, optimizer, by_name, options=StateDictOptions(full_state_dict=True))


def _gathered():
    """Full tensors, on rank 0's CPU only."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=True)
