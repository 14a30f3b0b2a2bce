"""What a node's cores deliver when more single-threaded processes compute than it has cores: the planner's
simulation shares them by processor sharing with nothing lost (planner/cores.py); this measures what is lost.

    .venv/bin/python bench/oversubscription.py --seconds 8

Each of N processes runs a small MLP forward on one torch thread for the same seconds; the aggregate forwards over
those of one process alone is the cores' delivered throughput (N = 1, 2, 3, 4, 6, 8, 12 by default). Nothing else
should run meanwhile.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import time


def _forwards(results, seconds: float) -> None:
    import torch

    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256))
    batch = torch.randn(64, 256)
    count, started = 0, time.perf_counter()
    with torch.no_grad():
        while time.perf_counter() - started < seconds:
            model(batch)
            count += 1
    results.put(count)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--processes", type=int, nargs="*", default=[2, 3, 4, 6, 8, 12],
                        help="The counts to run after one process alone, which every figure is over.")
    parser.add_argument("--out", default=None, help="Write the figures as JSON here.")
    args = parser.parse_args()
    context = multiprocessing.get_context("spawn")  # each process its own torch, as Ray's workers have
    alone, rows = None, []
    print(f"{os.cpu_count()} cores; {args.seconds:g} s a run", flush=True)
    for processes in [1, *(count for count in args.processes if count != 1)]:
        results = context.Queue()
        workers = [context.Process(target=_forwards, args=(results, args.seconds)) for _ in range(processes)]
        for worker in workers:
            worker.start()
        total = sum(results.get() for _ in workers)
        for worker in workers:
            worker.join()
        alone = alone or total
        rows.append({"processes": processes, "forwards": total, "of_one_alone": total / alone})
        print(f"{processes:3d} processes: {total:7d} forwards, {total / alone:.2f}x one alone", flush=True)
    if args.out:
        with open(args.out, "w") as out:
            json.dump({"cores": os.cpu_count(), "seconds": args.seconds, "rows": rows}, out, indent=1)


if __name__ == "__main__":
    main()
