"""A service outside the cluster under a quota, with the run's scheduler and without it (issue 51.4): the demo's
solver and verifier with a calculator tool (``arithmetic_tool``), every episode asking the calculator once after
the solver's turn. The calculator is a real HTTP server on 127.0.0.1 that refuses (429, ``Retry-After``) whatever
exceeds ``--quota`` requests in the sliding second before it arrives (tests/quota_proxy.py).

    .venv/bin/python -m bench.pipeline.services --steps 20 --quota 10

Side by side, one launch each from the same version 0: ``scheduled`` (one scheduler for the run's calls) and
``on their own`` (``services.calculator.scheduled: false``: each episode calls, and on a 429 retries after the
backoff and the ``Retry-After``, as a plugin calling the API directly with a retry decorator would). Reported: the
429s the server sent, its served rate while calls were waiting (bursts: arrivals closer than 0.5 s), the mean step
time (steps 1..), the calls' queue wait and latency as the run stored them.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from pathlib import Path

from bench.planner.planner import base_config, launch
from tests.quota_proxy import QuotaProxy

ROOT = Path(__file__).resolve().parents[2]


def busy_periods(arrivals: list[float], gap_s: float = 1.5) -> list[tuple[float, float]]:
    """(first, last) arrival of each period in which requests kept arriving, served or refused (a period ends at a
    gap above ``gap_s``: the rollout between two micro-batches' calls)."""
    periods, start = [], 0
    for i in range(1, len(arrivals) + 1):
        if i == len(arrivals) or arrivals[i] - arrivals[i - 1] > gap_s:
            if i - start >= 2:
                periods.append((arrivals[start], arrivals[i - 1]))
            start = i
    return periods


def served_rate(served: list[float], periods: list[tuple[float, float]]) -> float | None:
    """Requests served a second within the busy periods."""
    seconds = sum(end - start for start, end in periods)
    return sum(any(start <= t <= end for start, end in periods) for t in served) / seconds if seconds else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=Path("/tmp/services_bench"))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--quota", type=float, default=10.0, help="The calculator's requests a second.")
    parser.add_argument("--latency", type=float, default=0.05, help="The calculator's seconds per call.")
    args = parser.parse_args()

    import ray

    from marl_pipeline.services.figures import service_summary
    from marl_pipeline.store import ExperienceStore

    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    store_uri = args.work / "store"
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    results = {}
    for name, scheduled in (("scheduled", True), ("on_their_own", False)):
        proxy = QuotaProxy(requests_per_second=args.quota, latency_s=args.latency, retry_after_s=1.0,
                           answer=lambda path, body: {"sum": body["a"] + body["b"]})
        data = base_config("pair")
        data["pipeline"]["steps"] = args.steps
        data["environment"] = {"name": "arithmetic_tool", "options": data["environment"].get("options", {})}
        data["services"] = {"calculator": {"base_url": proxy.url, "requests_per_second": args.quota,
                                           "scheduled": scheduled, "concurrency": 64}}
        started = time.time()
        try:
            seconds = launch(data, name, store_uri, "scheduled" if name != "scheduled" else None)
        finally:
            proxy.close()
        summary = service_summary(ExperienceStore(str(store_uri)), name)[0]
        periods = busy_periods(sorted(proxy.served + proxy.refused_at))
        rate = served_rate(proxy.served, periods)
        failed = [row for row in ExperienceStore(str(store_uri)).read_stage(
            name, "rollouts", columns=["status"]).column("status").to_pylist() if row != "ok"]
        results[name] = {
            "step_s": statistics.mean(seconds[1:]), "refused_429": proxy.refused, "served": len(proxy.served),
            "served_per_s_busy": rate, "quota_use_busy": rate / args.quota if rate else None,
            "busy_s": sum(end - start for start, end in periods), "failed_turns": len(failed),
            "stored": summary, "wall_s": time.time() - started}
        print(json.dumps({name: results[name]}, indent=1, default=str), flush=True)
    (args.work / "results.json").write_text(json.dumps(results, indent=1, default=str))
    print(f"| launch | step s | 429s | calls served | served/s while calls came (of {args.quota:g}) | "
          "calls given up | failed turns | queue wait p99 s | retries |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, row in results.items():
        stored = row["stored"]
        wait = "-" if stored["queue_wait_p99"] is None else f"{stored['queue_wait_p99']:.2f}"
        print(f"| {name} | {row['step_s']:.2f} | {row['refused_429']} | {row['served']} | "
              f"{row['served_per_s_busy']:.2f} ({row['quota_use_busy']:.0%}) | {stored['failures']} | "
              f"{row['failed_turns']} | {wait} | {stored['retries']} |")


if __name__ == "__main__":
    main()
