"""Benchmark: the action-level pool against one sandbox (worker) held per trajectory, in one run.

The environment's actions have a heavy-tailed latency and some fail. Each attempt of an action
sleeps (an I/O-bound sandbox or tool round trip; the sleep holds no CPU, so the 2-core machine does
not distort it): median ``--median`` seconds, and with probability ``--stall`` a stall of
``--stall-seconds`` (a hung tool call, a stuck sandbox), so p99 latency is at least 20x the
median. ``--fail`` of the actions raise. Which actions stall and which fail is fixed per action, so both
schedulers see the same ones. Both start warm (workers ready before the clock starts).

Both schedulers use the same worker actor class, the same per-action timeout and the same number
of retries:

- per-trajectory (baseline): one worker per trajectory, spawned at the start and held until the
  trajectory's last action is done; its actions run one after another. A timed-out action kills
  that trajectory's worker, which is respawned before the retry and the rest of its actions.
- action-level (ours): every action of the micro-batch is queued at once on an elastic pool
  (min..max workers, sized by queue length); a timed-out action is retried on any warm worker.

Reported per scheduler: mean and p99 action completion time (from the micro-batch's start to the
action's outcome), worker-seconds (each worker's lifetime, spawn to kill, summed) and failures.

    .venv/bin/python bench/actions.py [--trajectories 8] [--actions 16] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import time
import zlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import ray

from marl_pipeline.action_pool import ActionPool, ActionWorker, Job, PoolSettings


def simulated_action(latency: float, fails: bool, stall: float, stall_seconds: float, seed: int) -> str:
    """One attempt: sleep (stalling with probability ``stall``, drawn from the action's seed), then succeed or raise."""
    rng = np.random.default_rng(seed)  # fixed per action: both schedulers see the same slow actions
    time.sleep(stall_seconds if rng.random() < stall else latency)
    if fails:
        raise RuntimeError("simulated action failure")
    return "ok"


def make_jobs(args: argparse.Namespace, round_: int) -> list[list[Job]]:
    """Per trajectory, its actions (same draws for both schedulers in a round)."""
    rng = np.random.default_rng([args.seed, round_])
    trajectories = []
    for t in range(args.trajectories):
        jobs = []
        for a in range(args.actions):
            latency = float(args.median * rng.lognormal(0.0, 0.25))
            fails = bool(rng.random() < args.fail)
            seed = zlib.crc32(f"{round_}/{t}/{a}".encode())
            jobs.append(Job(simulated_action, (latency, fails, args.stall, args.stall_seconds, seed),
                            expected_cost=args.median))
        trajectories.append(jobs)
    return trajectories


def per_trajectory(trajectories: list[list[Job]], settings: PoolSettings) -> dict:
    """Baseline: one worker per trajectory, held for the whole trajectory; actions in sequence."""
    actor = ray.remote(ActionWorker).options(num_cpus=settings.num_cpus)
    warm = [actor.remote() for _ in trajectories]  # a warm sandbox per trajectory, ready before the clock starts
    ray.get([handle.ready.remote() for handle in warm])
    start = time.monotonic()

    def run_trajectory(jobs: list[Job], handle) -> tuple[list[float], int, float]:
        spawned = start
        worker_seconds, completions, failures = 0.0, [], 0
        for job in jobs:
            for attempt in range(settings.retries + 1):
                # The same worker code as the pool's: a stuck attempt is abandoned at the timeout.
                status, _, _, _ = ray.get(handle.run.remote(job.fn, job.args, settings.timeout_s))
                if status != "timeout":
                    failures += status != "ok"
                    break
                if attempt == settings.retries:
                    failures += 1
            completions.append(time.monotonic() - start)
        ray.kill(handle)
        return completions, failures, worker_seconds + time.monotonic() - spawned  # held until the last action

    with ThreadPoolExecutor(len(trajectories)) as threads:
        results = list(threads.map(run_trajectory, trajectories, warm))
    return _summary([c for r in results for c in r[0]], sum(r[1] for r in results), sum(r[2] for r in results),
                    time.monotonic() - start, len(trajectories))


def action_level(trajectories: list[list[Job]], settings: PoolSettings) -> dict:
    """Ours: every action queued at once on an elastic pool (warm at min_workers, as between micro-batches)."""
    pool = ActionPool(settings)
    pool.wait_ready()
    start = time.monotonic()
    outcomes = pool.map([job for jobs in trajectories for job in jobs])
    elapsed = time.monotonic() - start
    worker_seconds = pool.worker_seconds(since=start)
    pool.shutdown()
    return _summary([o.finished - start for o in outcomes], sum(o.status != "ok" for o in outcomes),
                    worker_seconds, elapsed, pool.peak_workers)


def _summary(completions: list[float], failures: int, worker_seconds: float, elapsed: float, peak: int) -> dict:
    values = np.asarray(completions)
    return {"mean_s": float(values.mean()), "p99_s": float(np.percentile(values, 99)), "worker_s": worker_seconds,
            "makespan_s": elapsed, "failures": failures, "actions": len(completions), "peak_workers": peak}


def latency_profile(args: argparse.Namespace) -> dict:
    """Median and p99 of the attempt latency the generator draws (no scheduling, no sleeping)."""
    rng = np.random.default_rng(args.seed)
    samples = args.median * rng.lognormal(0.0, 0.25, 200_000)
    samples[rng.random(samples.size) < args.stall] = args.stall_seconds
    return {"median_s": float(np.median(samples)), "p99_s": float(np.percentile(samples, 99))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trajectories", type=int, default=8)
    parser.add_argument("--actions", type=int, default=16, help="actions per trajectory")
    parser.add_argument("--median", type=float, default=0.02, help="median action latency, seconds")
    parser.add_argument("--stall", type=float, default=0.03, help="probability an attempt stalls")
    parser.add_argument("--stall-seconds", type=float, default=2.0)
    parser.add_argument("--fail", type=float, default=0.05, help="share of actions that raise")
    parser.add_argument("--timeout", type=float, default=0.25, help="per-action timeout, seconds")
    parser.add_argument("--retries", type=int, default=2)
    parser.add_argument("--min-workers", type=int, default=4)
    parser.add_argument("--max-workers", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    profile = latency_profile(args)
    print(f"attempt latency: median {profile['median_s'] * 1e3:.1f} ms, p99 {profile['p99_s'] * 1e3:.0f} ms "
          f"({profile['p99_s'] / profile['median_s']:.0f}x); {args.fail:.0%} of actions fail")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    settings = PoolSettings(min_workers=args.min_workers, max_workers=args.max_workers,
                            actions_per_worker=max(1, args.actions // 2), timeout_s=args.timeout,
                            retries=args.retries, num_cpus=0)
    rows = []
    for round_ in range(args.rounds):
        trajectories = make_jobs(args, round_)
        # Alternate which goes first, so machine noise hits both alike.
        order = [("per-trajectory", per_trajectory), ("action-level", action_level)]
        for name, scheduler in (order if round_ % 2 == 0 else order[::-1]):
            rows.append({"round": round_, "scheduler": name, **scheduler(trajectories, settings)})
            r = rows[-1]
            print(f"round {round_} {name:15s} mean {r['mean_s']:.3f} s  p99 {r['p99_s']:.3f} s  "
                  f"worker-s {r['worker_s']:.1f}  makespan {r['makespan_s']:.2f} s  failures {r['failures']}/"
                  f"{r['actions']}  peak workers {r['peak_workers']}")
    ray.shutdown()
    for name in ("per-trajectory", "action-level"):
        mine = [r for r in rows if r["scheduler"] == name]
        print(f"all rounds {name:15s} mean {np.mean([r['mean_s'] for r in mine]):.3f} s  "
              f"p99 {np.mean([r['p99_s'] for r in mine]):.3f} s  worker-s {np.mean([r['worker_s'] for r in mine]):.1f}")
    print(json.dumps({"profile": profile, "rows": rows}))


if __name__ == "__main__":
    main()
