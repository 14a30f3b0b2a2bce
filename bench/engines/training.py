"""Benchmark: trainer swapping and token-budget micro-batches (issue 12), side by side in one run.

1. **Swapping.** ``agents`` agents train the same steps (``micro_batches`` accumulate calls per agent, issued for
   every agent at once in the train stage's order, ``stages.training.issue_order``, then the optimizer step and
   the weight export the orchestrator issues) with every trainer resident (one actor each), with a trainer budget
   of ``budget`` (that many trainer workers swapping the agents' states through the Ray object store), and with
   that budget but the calls always in one order (as the train stage issued them before), all spawned by
   ``cluster/spawn.py``'s ``start_trainers``, step by step in turn on the same batches. Reported: each
   layout's median step time and its ratio to the resident one, the swaps' counts, bytes, seconds and GB/s
   against a plain memory copy of the same size, and whether the layouts end with bit-identical parameters.
2. **Swap round trip** of one trainer state alone (parameters, gradients, AdamW moments): the built-in tiny
   model's and, with ``--smollm2``, SmolLM2-135M's.
3. **Token budget.** One step over rows whose response lengths vary 10x: its peak memory above the trainer's
   baseline (model, gradients, AdamW moments, already allocated), measured in a fresh process per variant (the
   peak resident set, reset before the step through ``/proc/self/clear_refs``), for: one pass of exactly
   ``chunk_tokens`` padded tokens with rows at least as long as the step's longest (the most the budget allows),
   the step under that token budget (rows sorted by length, cut by ``length_chunks``), fixed-count micro-batches
   of ``fixed_rows`` rows each padded to its longest, and the whole step as one padded pass. glibc is told to map
   every allocation over 128 KiB on its own (``MALLOC_MMAP_THRESHOLD_``), so the resident set follows the live
   tensors rather than the heap's fragmentation. Also: each variant's parameters after two steps against one
   full-batch pass, in float64 (the claim is the algebra; float32 summation order differs by ~1e-7, which AdamW's
   first steps blow up).

    .venv/bin/python -m bench.engines.training --smollm2
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from marl_pipeline.planner.profiling import synthetic_batch
from marl_pipeline.stages.training import issue_order
from marl_pipeline.training.batches import TrainBatch
from marl_pipeline.training.trainer import PolicyTrainer

OPTIONS = dict(lr=1e-3, weight_decay=0.0, max_grad_norm=1.0, clip_eps=0.2, seed=0)


def rows_of(batch: TrainBatch, rows: list[int]) -> TrainBatch:
    return TrainBatch(*([field[r] for r in rows] for field in (batch.prompt_ids, batch.response_ids,
                                                              batch.old_logprobs, batch.advantages)))


def tiny_model(directory: Path) -> Path:
    from environments.arithmetic import ArithmeticCheck, ArithmeticOptions
    from marl_pipeline.bootstrap.tiny_model import build_tiny_model

    corpus = ArithmeticCheck(ArithmeticOptions()).text_corpus(np.random.default_rng(0), 500)
    return build_tiny_model(directory / "tiny", corpus, seed=0)


def model_vocab(model_dir) -> int:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir).vocab_size


def memcpy_gbps(nbytes: int, reps: int = 5) -> tuple[float, float]:
    """A plain memory copy of ``nbytes``, one torch thread, best of ``reps``: into memory written before (the
    bandwidth ceiling), and into fresh memory (``clone``: allocation and first-touch page faults included, what
    any move of a state into memory just given back to the system pays)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    source, target = torch.ones(nbytes, dtype=torch.uint8), torch.zeros(nbytes, dtype=torch.uint8)
    warm = fresh = float("inf")
    for _ in range(reps):
        started = time.perf_counter()
        target.copy_(source)
        warm = min(warm, time.perf_counter() - started)
        started = time.perf_counter()
        copy = source.clone()
        fresh = min(fresh, time.perf_counter() - started)
        del copy
    torch.set_num_threads(threads)
    return nbytes / warm / 1e9, nbytes / fresh / 1e9


def copy_figures(nbytes: int) -> str:
    warm, fresh = memcpy_gbps(nbytes)
    return f"plain copy {warm:.2f} GB/s into written memory, {fresh:.2f} GB/s into fresh memory"


# -- 1. swapping ------------------------------------------------------------------------------------------------
def bench_swapping(args, model_dir: Path, work: Path) -> None:
    import ray

    from marl_pipeline.cluster.spawn import plan_on_ray, start_trainers
    from marl_pipeline.config import ExperimentConfig
    from marl_pipeline.store import ExperienceStore

    agents = [f"agent{i}" for i in range(args.agents)]
    # All layouts alive at once (reservations small enough for all), 1 thread per actor: what the shared-thread
    # rule gives each of them on this 2-core machine.
    data = {"run": "bench", "store": str(work / "store"), "environment": {"name": "arithmetic"},
            "agents": {agent: {"trainer": {"num_cpus": 0.2, "threads": args.threads, "lr": OPTIONS["lr"]}}
                       for agent in agents}}
    budget = {**data, "ray": {"resident_trainers": args.budget}}
    # (config, whether the micro-batches' calls alternate their order as the train stage issues them)
    layouts = {"resident": (ExperimentConfig.model_validate(data), True),
               f"budget {args.budget}": (ExperimentConfig.model_validate(budget), True),
               f"budget {args.budget}, one order": (ExperimentConfig.model_validate(budget), False)}
    store = ExperienceStore(layouts["resident"][0].store)
    for agent in agents:
        shutil.copytree(model_dir, store.policy_dir("bench", agent, 0))
    versions = dict.fromkeys(agents, 0)
    trainers = {name: start_trainers(plan_on_ray(config), store, versions) for name, (config, _) in layouts.items()}
    ray.get([t.policy_version.remote() for handles in trainers.values() for t in handles.values()])
    vocab = model_vocab(model_dir)
    rng = np.random.default_rng(0)
    seconds: dict[str, list[float]] = {name: [] for name in layouts}
    weights = {}
    for step in range(args.steps + 1):  # step 0 warms up (a worker builds each agent's trainer on first use)
        batches = [{agent: synthetic_batch(args.rows, vocab, (8, 32), (4, 64), rng) for agent in agents}
                   for _ in range(args.micro_batches)]
        for name, handles in trainers.items():
            alternate = layouts[name][1]
            started = time.perf_counter()
            for index, batch in enumerate(batches):
                order = issue_order(agents, index) if alternate else agents
                ray.get([handles[agent].accumulate.remote(batch[agent]) for agent in order])
            applied = [handles[agent].apply_step.remote() for agent in agents]
            exported = [handles[agent].named_weights.remote() for agent in agents]
            ray.get(applied)
            weights[name] = ray.get(exported)
            if step:
                seconds[name].append(time.perf_counter() - started)
    medians = {name: statistics.median(times) for name, times in seconds.items()}
    identical = all(torch.equal(a, b) for name in list(layouts)[1:]
                    for mine, theirs in zip(weights["resident"], weights[name], strict=True)
                    for (_, a), (_, b) in zip(mine, theirs, strict=True))
    print(f"\n1. swapping: {args.agents} agents, {args.micro_batches} micro-batches x {args.rows} rows per agent per "
          f"step, {args.threads} thread per actor, {args.steps} steps after a warm-up")
    for name, times in seconds.items():
        print(f"  {name:>20}: median step {medians[name]:.2f} s  {[round(t, 2) for t in times]}"
              + (f"; / resident {medians[name] / medians['resident']:.2f}" if name != "resident" else ""))
    print(f"  parameters bit-identical across the layouts: {identical}")
    for name in list(layouts)[1:]:
        workers = {id(h.worker): h.worker for h in trainers[name].values()}
        stats = ray.get([worker.swap_stats.remote() for worker in workers.values()])
        out_bytes, in_bytes = sum(s.bytes_out for s in stats), sum(s.bytes_in for s in stats)
        out_s, in_s = sum(s.seconds_out for s in stats), sum(s.seconds_in for s in stats)
        swaps = sum(s.swaps_out for s in stats)
        size = out_bytes // max(swaps, 1)
        print(f"  {name}: swaps {swaps} out, {sum(s.swaps_in for s in stats)} in (all steps), {size / 1e6:.1f} MB "
              f"each on average; out {out_bytes / out_s / 1e9:.2f} GB/s, in {in_bytes / in_s / 1e9:.2f} GB/s; "
              f"{copy_figures(size)}; swap time {(out_s + in_s) / (args.steps + 1):.3f} s per step across workers")
    for handles in trainers.values():
        for handle in {id(h): getattr(h, "worker", h) for h in handles.values()}.values():
            ray.kill(handle)


# -- 2. one state's round trip ------------------------------------------------------------------------------------
def bench_round_trip(label: str, model_dir: str, reps: int) -> None:
    from marl_pipeline.training.swap import AgentSpec, TrainerWorker

    worker = TrainerWorker({"a": AgentSpec(model_dir, 0, {**OPTIONS, "num_threads": 2})})
    batch = synthetic_batch(2, model_vocab(model_dir), (4, 8), (2, 4), 0)
    worker.call("a", "accumulate", batch)
    worker.call("a", "apply_step")  # AdamW's moments exist
    worker.call("a", "accumulate", batch)  # and gradients
    for _ in range(reps):
        worker._swap_out("a")
        worker._swap_in("a")
        worker.loaded = "a"
    stats = worker.stats
    size = stats.bytes_out // stats.swaps_out
    print(f"  {label}: {size / 1e6:.0f} MB per state; out {stats.bytes_out / stats.seconds_out / 1e9:.2f} GB/s, in "
          f"{stats.bytes_in / stats.seconds_in / 1e9:.2f} GB/s (mean of {reps}); {copy_figures(size)}")
    del worker


# -- 3. token budget ----------------------------------------------------------------------------------------------
def token_budget_rows(args, vocab: int) -> TrainBatch:
    """Response lengths evenly spread from the shortest to the longest (10x apart by default), in random order."""
    rng = np.random.default_rng(1)
    batch = synthetic_batch(args.budget_rows, vocab, (16, 16), (1, 1), rng)
    lengths = rng.permutation(np.linspace(*args.response_tokens, args.budget_rows).round().astype(int))
    responses = [rng.integers(1, vocab, size=length).tolist() for length in lengths]
    return TrainBatch(batch.prompt_ids, responses, [(-rng.random(len(r)) * 3).tolist() for r in responses],
                      batch.advantages)


def _variants(args, batch: TrainBatch) -> dict[str, tuple[str, int, list[TrainBatch]]]:
    """Each variant's label, chunk_tokens and micro-batches, by a short key."""
    # The budget itself: one pass of exactly chunk_tokens padded tokens, its rows at least as long as the step's
    # longest (the smallest divisor of the budget that is), so no pass under the budget has more tokens or longer rows.
    longest = max(len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids))
    length = next(n for n in range(longest, args.chunk_tokens + 1) if args.chunk_tokens % n == 0)
    per_pass = args.chunk_tokens // length
    at_budget = synthetic_batch(per_pass, vocab_of(batch), (16, 16), (length - 16, length - 16), 2)
    rows = list(range(len(batch.prompt_ids)))
    fixed = [rows_of(batch, rows[i:i + args.fixed_rows]) for i in range(0, len(rows), args.fixed_rows)]
    return {
        "budget": (f"one pass of {per_pass} x {length} tokens (the budget)", args.chunk_tokens, [at_budget]),
        "token": (f"token budget {args.chunk_tokens}", args.chunk_tokens, [batch]),
        "fixed": (f"fixed count, {args.fixed_rows} rows", 10**9, fixed),
        "full": ("full batch, one pass", 10**9, [batch]),
    }


def vocab_of(batch: TrainBatch) -> int:
    return max(max(p + r) for p, r in zip(batch.prompt_ids, batch.response_ids)) + 1


def measure_peak(args) -> None:
    """In a fresh process: one variant's step, its peak resident set above the baseline (printed as JSON)."""
    import ctypes

    torch.set_num_threads(args.threads)
    batch = token_budget_rows(args, args.vocab)
    _, chunk_tokens, micro_batches = _variants(args, batch)[args.measure]
    trainer = PolicyTrainer(args.model_dir, 0, **OPTIONS, num_threads=args.threads, chunk_tokens=chunk_tokens)
    warm = synthetic_batch(2, args.vocab, (4, 4), (4, 4), 3)
    trainer.accumulate(warm)
    trainer.apply_step()  # AdamW's moments allocated
    trainer.accumulate(warm)  # and the gradients
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")  # resets the peak resident set (VmHWM) to the current one
    baseline = _status_kb("VmRSS")
    for micro_batch in micro_batches:
        trainer.accumulate(micro_batch)
    trainer.apply_step()
    state = sum(p.numel() * p.element_size() * 4 for p in trainer.model.parameters())  # weights, grads, 2 moments
    print(json.dumps({"peak_mb": (_status_kb("VmHWM") - baseline) / 1024, "baseline_mb": baseline / 1024,
                      "state_mb": state / 2**20}))


def _status_kb(field: str) -> int:
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith(field))
    return int(line.split()[1])


def bench_token_budget(args, model_dir: Path) -> None:
    vocab = model_vocab(model_dir)
    batch = token_budget_rows(args, vocab)
    responses = [len(r) for r in batch.response_ids]
    print(f"\n3. token budget: {len(responses)} rows, responses {min(responses)}-{max(responses)} tokens, prompts 16; "
          f"{args.threads} threads")
    variants = _variants(args, batch)
    for key, (label, _, _) in variants.items():
        command = [sys.executable, __file__, "--measure", key, "--model-dir", str(model_dir), "--vocab", str(vocab),
                   *sys.argv[1:]]
        # Every allocation over 128 KiB its own mapping, returned when freed: the resident set then follows the
        # live tensors, not the heap's fragmentation (which varies with the order of allocation sizes).
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}
        result = json.loads(subprocess.run(command, check=True, capture_output=True, text=True,
                                           env=env).stdout.splitlines()[-1])
        print(f"  {label:>42}: peak {result['peak_mb']:7.1f} MB above the baseline ({result['baseline_mb']:.0f} MB "
              f"resident, of which weights + gradients + AdamW {result['state_mb']:.1f} MB)", flush=True)
    # The same update: every variant against one full-batch pass, two steps, float64.
    finals = {}
    for key, (label, chunk_tokens, micro_batches) in variants.items():
        if key == "budget":
            continue
        trainer = PolicyTrainer(str(model_dir), 0, **OPTIONS, num_threads=args.threads, chunk_tokens=chunk_tokens)
        trainer.model.double()
        for _ in range(2):
            for micro_batch in micro_batches:
                trainer.accumulate(micro_batch)
            trainer.apply_step()
        finals[label] = list(trainer.model.parameters())
    reference = finals.pop(variants["full"][0])
    for label, params in finals.items():
        worst = max((a - b).abs().max().item() for a, b in zip(params, reference))
        print(f"  {label:>42}: max |parameter - full batch's| after 2 steps {worst:.1e} (float64)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, default=4)
    parser.add_argument("--budget", type=int, default=2, help="resident trainers (trainer workers) when swapping")
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--rows", type=int, default=32, help="rows per agent per micro-batch")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--round-trips", type=int, default=5)
    parser.add_argument("--smollm2", action="store_true", help="also SmolLM2-135M's state round trip")
    parser.add_argument("--budget-rows", type=int, default=64)
    parser.add_argument("--response-tokens", type=int, nargs=2, default=(16, 160), metavar=("MIN", "MAX"))
    parser.add_argument("--chunk-tokens", type=int, default=2048)
    parser.add_argument("--fixed-rows", type=int, default=16)
    parser.add_argument("--parts", default="swap,budget", help="which parts: swap (1 and 2), budget (3)")
    parser.add_argument("--measure", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--vocab", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        measure_peak(args)
        return

    import ray

    print(f"cpu {os.cpu_count()}, torch {torch.__version__}, ray {ray.__version__}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model_dir = tiny_model(work)
        if "swap" in args.parts:
            ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
            try:
                bench_swapping(args, model_dir, work)
                print("\n2. one state's swap round trip (out to the object store, back in)")
                bench_round_trip("built-in tiny", str(model_dir), args.round_trips)
                if args.smollm2:
                    from marl_pipeline.bootstrap.model_sources import resolve_model_source

                    bench_round_trip("SmolLM2-135M", str(resolve_model_source("smollm2-135m-instruct")),
                                     args.round_trips)
            finally:
                ray.shutdown()
        if "budget" in args.parts:
            bench_token_budget(args, model_dir)

if __name__ == "__main__":
    main()
