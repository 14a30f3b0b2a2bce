"""What a node's cores deliver when more single-threaded processes compute than it has cores: the planner's
simulation shares them by processor sharing with nothing lost (planner/shared_cores.py); this measures what is lost.

    .venv/bin/python -m bench.planner.oversubscription --seconds 8
    .venv/bin/python -m bench.planner.oversubscription --workload train --seconds 10 --processes 2 3 4 5 6 8 10
    .venv/bin/python -m bench.planner.oversubscription --workload engine --model DIR --seconds 15 --processes 2 4 6

Each of N processes does the same work on one torch thread for the same seconds, all starting together once every
one is ready (built and warmed up): ``mlp``, a small MLP's forward (big kernels, little else); ``train``, a training
step (forward, backward, AdamW) of the built-in tiny model's architecture, as the planner bench's trainers run it
(small kernels between much Python); ``engine``, a batch of 128 requests of 40 prompt tokens and 16 sampled ones on
this project's vLLM engine (inference/engine.py) serving ``--model`` (a store's ``models/name=builtin/version=0``),
as the planner bench's engines run it. The aggregate work over that of one process alone is the cores' delivered
throughput; work per CPU-second says how much more CPU the same work took (N = 1, then ``--processes``). Nothing
else should run meanwhile.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import time
from pathlib import Path


def _mlp():
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256))
    batch = torch.randn(64, 256)

    def forward():
        with torch.no_grad():
            model(batch)
    return forward


def _train():
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from marl_pipeline.bootstrap.tiny_model import TINY_ARCHITECTURE

    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=384, **TINY_ARCHITECTURE))
    optimizer = torch.optim.AdamW(model.parameters(), 1e-3)
    tokens = torch.randint(0, 384, (8, 48))

    def step():
        model(tokens, labels=tokens).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return step


def _engine(model_dir: str):
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process, as in a Ray actor
    from marl_pipeline.inference.engine import GenerationRequest, RolloutEngine

    engine = RolloutEngine(model_dir, 0, gpu_memory_utilization=0.9, max_model_len=512, dtype="float32", seed=0,
                           threads=1, kv_cache_gib=0.25)
    vocab = json.loads(Path(model_dir, "config.json").read_text())["vocab_size"]

    def batch():
        engine.generate([GenerationRequest(prompt=[(i * 7 + j) % (vocab - 8) + 4 for j in range(40)], seed=i,
                                           max_tokens=16, temperature=1.0, ignore_eos=True) for i in range(128)])
    return batch


def _work(results, ready, start, seconds: float, workload: str, model_dir: str | None) -> None:
    import torch

    torch.set_num_threads(1)
    unit = {"mlp": _mlp, "train": _train}[workload]() if workload != "engine" else _engine(model_dir)
    for _ in range(3):
        unit()
    ready.put(True)
    start.wait()
    count, started, cpu = 0, time.perf_counter(), time.process_time()
    while time.perf_counter() - started < seconds:
        unit()
        count += 1
    results.put((count, time.process_time() - cpu, time.perf_counter() - started))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--processes", type=int, nargs="*", default=[2, 3, 4, 6, 8, 12],
                        help="The counts to run after one process alone, which every figure is over.")
    parser.add_argument("--workload", choices=["mlp", "train", "engine"], default="mlp")
    parser.add_argument("--model", default=None, help="The model directory the engine workload serves.")
    parser.add_argument("--out", default=None, help="Write the figures as JSON here.")
    args = parser.parse_args()
    if args.workload == "engine" and not (args.model and os.path.isfile(os.path.join(args.model, "config.json"))):
        parser.error(f"--workload engine needs --model, a model directory with a config.json (got {args.model!r})")
    context = multiprocessing.get_context("spawn")  # each process its own torch, as Ray's workers have
    alone, rows = None, []
    print(f"{os.cpu_count()} cores; {args.workload}; {args.seconds:g} s a run", flush=True)
    for processes in [1, *(count for count in args.processes if count != 1)]:
        results, ready, start = context.Queue(), context.Queue(), context.Event()
        workers = [context.Process(target=_work, args=(results, ready, start, args.seconds, args.workload,
                                                       args.model)) for _ in range(processes)]
        for worker in workers:
            worker.start()
        for _ in workers:
            ready.get(timeout=600)
        start.set()
        done = [results.get(timeout=args.seconds * 4 + 600) for _ in workers]
        for worker in workers:
            worker.join()
        units, cpu = sum(d[0] for d in done), sum(d[1] for d in done)
        rate = units / max(d[2] for d in done)
        alone = alone or rate
        rows.append({"processes": processes, "units_per_second": rate, "of_one_alone": rate / alone,
                     "units_per_cpu_second": units / cpu})
        print(f"{processes:3d} processes: {rate:8.2f} a second, {rate / alone:.2f}x one alone, "
              f"{units / cpu:.2f} per CPU-second", flush=True)
    if args.out:
        with open(args.out, "w") as out:
            json.dump({"cores": os.cpu_count(), "workload": args.workload, "seconds": args.seconds, "rows": rows},
                      out, indent=1)


if __name__ == "__main__":
    main()
