"""An agent's trainer on several workers (training/sharded.py): two FSDP2 ranks over gloo take one worker's step, its
AdamW state included, and a version saved by either resumes on the other."""

from __future__ import annotations

import socket
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file

from marl_pipeline.cluster.trainers import _rows
from marl_pipeline.policy.checkpoint import load_policy
from marl_pipeline.training.batches import TrainBatch
from marl_pipeline.training.sharded import Rank, deal, merged_stats
from marl_pipeline.training.trainer import TRAINER_STATE, PolicyTrainer

pytestmark = pytest.mark.launch

OPTIONS = dict(lr=1e-2, weight_decay=0.01, max_grad_norm=1.0, clip_eps=0.2, seed=0, num_threads=1,
               loss_normalization="token", kl_coef=0.1, entropy_coef=0.01, chunk_tokens=16)


def _load_float64(model_dir: str):
    # float64: the claim is that N ranks compute the same function of the data; in float32 the summation order
    # differs (~1e-7), which AdamW's first steps blow up for near-zero gradients (tests/test_trainer.py).
    model, tokenizer = load_policy(model_dir)
    return model.double(), tokenizer


class Float64Trainer(PolicyTrainer):
    load = staticmethod(_load_float64)


def _steps(seed: int) -> list[list[TrainBatch]]:
    """Two steps of uneven micro-batches (one with a single row: a rank gets none of it)."""
    rng = np.random.default_rng(seed)
    steps = []
    for sizes in ([5, 1, 7], [4, 6]):
        step = []
        for rows in sizes:
            prompts = [rng.integers(1, 250, size=rng.integers(2, 9)).tolist() for _ in range(rows)]
            responses = [rng.integers(1, 250, size=rng.integers(1, 9)).tolist() for _ in range(rows)]
            old = [(-rng.random(len(r)) * 3).tolist() for r in responses]
            step.append(TrainBatch(prompts, responses, old, rng.normal(size=rows).tolist(), dropped_rows=1))
        steps.append(step)
    return steps


def _train(trainer: PolicyTrainer, steps: list[list[TrainBatch]], world: int, rank: int) -> list[dict]:
    stats = []
    for step in steps:
        for batch in step:
            lengths = [len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids)]
            share = deal(lengths, world)[rank]
            stats.append(trainer.accumulate(_rows(batch, share, batch.dropped_rows if rank == 0 else 0)))
        stats.append(vars(trainer.apply_step()))
    return stats


def _rank(rank: int, world: int, addresses: list[str], model_dir: str, out: str, results) -> None:
    """One rank: two steps from version 0 saved as version 2, then one step from the one-worker run's version 2."""
    try:
        trainer = Float64Trainer(model_dir, 0, rank=Rank(rank, world, addresses[0]), reference_dir=model_dir,
                                 **OPTIONS)
        stats = _train(trainer, _steps(1), world, rank)
        trainer.save(f"{out}/sharded-2")
        dist.destroy_process_group()
        resumed = Float64Trainer(f"{out}/single-2", 2, rank=Rank(rank, world, addresses[1]), reference_dir=model_dir,
                                 **OPTIONS)
        assert resumed.resumed_optimizer
        stats += _train(resumed, _steps(2)[:1], world, rank)
        resumed.save(f"{out}/sharded-3")
        dist.destroy_process_group()
        results.put((rank, stats))
    except BaseException as error:
        results.put((rank, repr(error)))
        raise


def _free_address() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{probe.getsockname()[1]}"


def _assert_same_version(one: Path, other: Path) -> None:
    weights, theirs = load_file(one / "model.safetensors"), load_file(other / "model.safetensors")
    assert weights.keys() == theirs.keys()
    for name in weights:
        torch.testing.assert_close(theirs[name], weights[name], rtol=0, atol=1e-6, msg=name)
    state, their_state = (torch.load(d / TRAINER_STATE, weights_only=True) for d in (one, other))
    assert state["version"] == their_state["version"]
    groups = [[{key: list(v) if isinstance(v, tuple) else v for key, v in group.items()}  # betas: tuple or list
               for group in s["optimizer"]["param_groups"]] for s in (state, their_state)]
    assert groups[0] == groups[1]
    assert state["optimizer"]["state"].keys() == their_state["optimizer"]["state"].keys()
    for index, moments in state["optimizer"]["state"].items():
        for name, value in moments.items():  # step, exp_avg, exp_avg_sq (the squares are tiny: relative)
            torch.testing.assert_close(their_state["optimizer"]["state"][index][name], value, rtol=1e-6, atol=1e-12)


TIMED = ("compute_seconds", "tokens_per_second", "mfu", "peak_tflops")


def _untimed(stats: dict) -> dict:
    return {key: value for key, value in stats.items() if key not in TIMED}


def test_two_ranks_take_one_workers_step_and_resume_each_others_versions(tiny_model_dir: Path,
                                                                         tmp_path: Path) -> None:
    model_dir = str(tiny_model_dir)
    single = Float64Trainer(model_dir, 0, reference_dir=model_dir, **OPTIONS)
    single_stats = _train(single, _steps(1), 1, 0)
    single.save(str(tmp_path / "single-2"))

    context = mp.get_context("spawn")
    results = context.Queue()
    addresses = [_free_address(), _free_address()]
    ranks = [context.Process(target=_rank, args=(k, 2, addresses, model_dir, str(tmp_path), results))
             for k in range(2)]
    for process in ranks:
        process.start()
    outcomes = dict(results.get(timeout=300) for _ in ranks)
    for process in ranks:
        process.join(timeout=60)
    assert all(isinstance(stats, list) for stats in outcomes.values()), outcomes

    _assert_same_version(tmp_path / "single-2", tmp_path / "sharded-2")
    rank_stats = list(zip(outcomes[0], outcomes[1]))
    micro_batches = [(a, b) for a, b in rank_stats if "loss_sum" in a]
    steps = [a for a, _ in rank_stats if "grad_norm" in a]
    assert len(micro_batches) == 3 + 2 + 3 and len(steps) == 2 + 1
    single_micro = [s for s in single_stats if "loss_sum" in s]
    for merged, own in zip((merged_stats(list(pair)) for pair in micro_batches[:5]), single_micro):
        assert max(pair["compute_seconds"] for pair in (merged, own)) > 0  # timings: measured, not compared
        # one worker's statistics of the whole micro-batch
        assert _untimed(merged) == pytest.approx(_untimed(own), rel=1e-6, abs=1e-9)
    # the step's counts are the sum over the ranks on every rank, as one worker counts them
    for step, own in zip(steps[:2], [s for s in single_stats if "grad_norm" in s]):
        assert step.pop("passes") == own.pop("passes") == "padded"
        assert _untimed(step) == pytest.approx(_untimed(own), rel=1e-6)
    assert _untimed(outcomes[0][-1]) == _untimed(outcomes[1][-1])  # each rank times its own passes

    # The one-worker run resumed from its own version 2 takes the step the two ranks took from it.
    resumed = Float64Trainer(str(tmp_path / "single-2"), 2, reference_dir=model_dir, **OPTIONS)
    _train(resumed, _steps(2)[:1], 1, 0)
    resumed.save(str(tmp_path / "single-3"))
    _assert_same_version(tmp_path / "single-3", tmp_path / "sharded-3")
    # and the two ranks' version 2 (gathered, in the one-worker format) is what a one-worker trainer loads
    from_sharded = Float64Trainer(str(tmp_path / "sharded-2"), 2, reference_dir=model_dir, **OPTIONS)
    assert from_sharded.resumed_optimizer and from_sharded.version == 2
