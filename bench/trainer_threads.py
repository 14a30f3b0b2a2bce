"""Benchmark: what a trainer's second (and further) thread buys on the built-in tiny model, the planner bench's model.

Without a thread profile, the planner's simulation takes an actor's work on T threads as done T times as fast
(planner/threads.py); the placement gives a lone synchronous trainer worker every core of its node. This times one
``PolicyTrainer`` in this process, its ``accumulate`` of a micro-batch shaped like the bench's (short prompts and
responses, many rows) and its ``apply_step``, at each thread count in turn, rep by rep (so a drift of the host weighs on
every count alike): the median wall seconds, the speed-up over one thread, and the process's CPU seconds over its wall
seconds (the cores it kept busy, spinning threads included).

    .venv/bin/python bench/trainer_threads.py --threads 1 2 --reps 9 --out threads.json

``--out`` writes the speed-ups as a thread profile (planner/threads.py) that ``marl plan --threads-profile`` reads;
bench/planner.py measures one so before it writes its predictions.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--rows", type=int, default=256, help="rows a micro-batch (the demo's: 16 prompts x 16)")
    parser.add_argument("--prompt-tokens", type=int, nargs=2, default=(3, 8), metavar=("MIN", "MAX"))
    parser.add_argument("--response-tokens", type=int, nargs=2, default=(1, 3), metavar=("MIN", "MAX"))
    parser.add_argument("--out", type=Path, help="write the speed-ups as a thread profile (--threads 1 2 ... n)")
    args = parser.parse_args()
    if args.out and args.threads != list(range(1, len(args.threads) + 1)):
        parser.error(f"--out: a thread profile needs --threads 1 2 ... n, not {args.threads}")

    from planner import base_config
    from trainer_throughput import make_batch
    from training import tiny_model

    from marl_pipeline.cluster.specs import trainer_options
    from marl_pipeline.config import parse_config
    from marl_pipeline.policy.precision import cpu_name
    from marl_pipeline.training.trainer import PolicyTrainer

    model = tiny_model(Path(tempfile.mkdtemp()))
    config = parse_config({**base_config("pair"), "run": "threads", "store": tempfile.mkdtemp()})
    options = trainer_options(config, next(iter(config.agents)), 1)  # the bench's trainer settings
    options |= {key: str(model) for key in ("reference_dir", "base_dir") if options[key]}
    trainer = PolicyTrainer(str(model), 0, **options)
    batch = make_batch(args.rows, 200, tuple(args.prompt_tokens), tuple(args.response_tokens))
    trainer.accumulate(batch)  # warm-up: first-call allocations and kernels
    trainer.apply_step()
    wall: dict[int, list[float]] = {threads: [] for threads in args.threads}
    cores: dict[int, list[float]] = {threads: [] for threads in args.threads}
    for rep in range(args.reps):
        for threads in args.threads if rep % 2 == 0 else args.threads[::-1]:
            torch.set_num_threads(threads)
            began, cpu = time.perf_counter(), time.process_time()
            trainer.accumulate(batch)
            trainer.apply_step()
            seconds = time.perf_counter() - began
            wall[threads].append(seconds)
            cores[threads].append((time.process_time() - cpu) / seconds)
        print(f"rep {rep + 1}/{args.reps}: " + ", ".join(f"{t} threads {wall[t][-1]:.3f} s" for t in args.threads),
              flush=True)
    one = statistics.median(wall[args.threads[0]])
    print(f"| threads | median s (accumulate + apply_step) | speed-up over {args.threads[0]} | cores kept busy |")
    print("| --- | --- | --- | --- |")
    for threads in args.threads:
        median = statistics.median(wall[threads])
        print(f"| {threads} | {median:.3f} | {one / median:.2f} | {statistics.median(cores[threads]):.2f} |")
    if args.out:
        args.out.write_text(json.dumps({
            "cpu": cpu_name(), "command": " ".join(sys.argv), "written": time.time(),
            "trainer": {str(t): round(one / statistics.median(wall[t]), 4) for t in args.threads},
            "cores_busy": {str(t): round(statistics.median(cores[t]), 3) for t in args.threads}}, indent=1))
        print(f"thread profile written to {args.out}")



if __name__ == "__main__":
    main()
