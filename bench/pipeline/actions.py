"""Benchmark: the action-level pool against one sandbox (worker) held per trajectory, in one run.

The environment's actions have a heavy-tailed latency and some fail. Each attempt of an action
sleeps (an I/O-bound sandbox or tool round trip; the sleep holds no CPU, so the 2-core machine does
not distort it): median ``--median`` seconds, and with probability ``--stall`` a stall of
``--stall-seconds``, so p99 latency is at least 20x the median. ``--fail`` of the actions raise (on
every attempt). Two kinds of stall (``--stall-kind``, one or both in one run):

- ``transient``: each *attempt* stalls with probability ``--stall`` (a hung tool call, a stuck
  sandbox): a fresh attempt of the same action escapes it (unless it stalls too, with the same odds);
- ``intrinsic``: each *action* stalls on every attempt (the action itself is slow): nothing escapes it.

The draw is seeded by (action, attempt number) for transient stalls and by the action alone for
intrinsic ones, so both schedulers see identical draws for the same (action, attempt). The attempt
number is counted on the worker side, without touching the pool's API: each job carries a unique
action key and a fresh temporary directory per scheduler and round, and an attempt claims the first
``n`` for which ``os.open(f"{dir}/{key}.{n}", O_CREAT | O_EXCL)`` succeeds (atomic across worker
processes). A retry after a timeout is a new attempt, and so is the pool's hedged copy: a hedge is
a fresh run of the action, which is what lets it escape a transient stall. Both start warm (workers
ready before the clock starts).

Each trajectory is multi-turn: before each action its agent generates for ``--generation-seconds``
(median, lognormal, drawn per turn, the same for both). Both schedulers use the same worker actor
class, the same per-action timeout and the same number of retries:

- per-trajectory (baseline): one warm worker (sandbox) per trajectory, held from the start through
  every generation turn until the trajectory's last action is done; its actions run one after another.
  It cannot hedge: a duplicate attempt would need a second sandbox per trajectory, i.e. double its
  worker-seconds.
- action-level (ours): each trajectory submits its next action to one shared elastic pool when its
  agent reaches it (warm at ``--min-workers``); while an agent generates, the pool's workers serve
  other trajectories' actions, grow by queue length (one start at a time) and retire after
  ``--idle-grace`` seconds idle, down to ``--min-workers``. With ``--hedge-after`` the pool hedges an
  attempt still running after that many seconds (``PoolSettings.hedge_after_s``); the same pool without
  hedging then runs too ("action-level, no hedge"), to show what the hedge buys.

Reported per scheduler: mean and p99 action completion time (ACT, as in ARL-Tangram: from the
action's issue to its outcome, queueing and every attempt included) -- the primary measure; mean and
p99 time from the round's start to the action's outcome (secondary); worker-seconds (each worker's
lifetime from the round's start to its kill, or to the last action for workers still alive, summed;
the same accounting for both), failures and (pool) hedged actions. The bar, on p99 ACT: ours <= 0.5x
the baseline's at <= 1x its worker-seconds, or within 2% (equal) at <= 0.6x its worker-seconds.

    .venv/bin/python -m bench.pipeline.actions [--stall-kind transient intrinsic] [--hedge-after 0.1] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import zlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import ray

from marl_pipeline.actions.pool import ActionPool
from marl_pipeline.actions.worker import ActionWorker, Job
from marl_pipeline.config import PoolSettings

Trajectories = list[list[tuple[float, Job]]]


def attempt_number(directory: str, key: str) -> int:
    """This attempt's number for action ``key``: the first ``n`` whose marker file this call creates (O_EXCL is
    atomic across worker processes, so concurrent copies of one action get distinct numbers)."""
    n = 0
    while True:
        try:
            os.close(os.open(f"{directory}/{key}.{n}", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            return n
        except FileExistsError:
            n += 1


def simulated_action(directory: str, key: str, latency: float, fails: bool, stall: float, stall_seconds: float,
                     intrinsic: bool, seed: int) -> str:
    """One attempt: sleep (stalling with probability ``stall``), then succeed or raise. The stall is drawn from the
    action's seed (intrinsic: every attempt alike) or from (seed, attempt number) (transient)."""
    n = attempt_number(directory, key)
    rng = np.random.default_rng(seed if intrinsic else [seed, n])  # both schedulers see the same draws
    time.sleep(stall_seconds if rng.random() < stall else latency)
    if fails:
        raise RuntimeError("simulated action failure")
    return "ok"


def make_jobs(args: argparse.Namespace, round_: int, kind: str, directory: str) -> Trajectories:
    """Per trajectory, its turns as (generation seconds before the action, action); same draws for both schedulers
    (``directory``, fresh per scheduler, only counts attempts)."""
    rng = np.random.default_rng([args.seed, round_])
    trajectories = []
    for t in range(args.trajectories):
        turns = []
        for a in range(args.actions):
            latency = float(args.median * rng.lognormal(0.0, 0.25))
            fails = bool(rng.random() < args.fail)
            generation = float(args.generation_seconds * rng.lognormal(0.0, 0.5))
            seed = zlib.crc32(f"{round_}/{t}/{a}".encode())
            action = (directory, f"{t}-{a}", latency, fails, args.stall, args.stall_seconds, kind == "intrinsic", seed)
            turns.append((generation, Job(simulated_action, action, expected_cost=args.median)))
        trajectories.append(turns)
    return trajectories


def per_trajectory(trajectories: Trajectories, settings: PoolSettings) -> dict:
    """Baseline: one worker per trajectory, held for the whole trajectory (generation turns included)."""
    actor = ray.remote(ActionWorker).options(num_cpus=settings.num_cpus)
    warm = [actor.remote() for _ in trajectories]  # a warm sandbox per trajectory, ready before the clock starts
    ray.get([handle.ready.remote() for handle in warm])
    start = time.monotonic()

    def run_trajectory(turns: list[tuple[float, Job]], handle) -> tuple[list[float], list[float], int, float]:
        completions, latencies, failures = [], [], 0
        for generation, job in turns:
            time.sleep(generation)  # the agent generates its next turn; the sandbox is held, idle
            issued = time.monotonic()
            for attempt in range(settings.retries + 1):
                # The same worker code as the pool's: a stuck attempt is abandoned at the timeout.
                status, _, _, _ = ray.get(handle.run.remote(job.fn, job.args, settings.timeout_s))
                if status != "timeout":
                    failures += status != "ok"
                    break
                if attempt == settings.retries:
                    failures += 1
            completions.append(time.monotonic() - start)
            latencies.append(time.monotonic() - issued)
        ray.kill(handle)
        return completions, latencies, failures, time.monotonic() - start  # held from the start to its last action

    with ThreadPoolExecutor(len(trajectories)) as threads:
        results = list(threads.map(run_trajectory, trajectories, warm))
    return _summary([c for r in results for c in r[0]], [x for r in results for x in r[1]],
                    sum(r[2] for r in results), sum(r[3] for r in results), time.monotonic() - start,
                    len(trajectories), 0)


def action_level(trajectories: Trajectories, settings: PoolSettings) -> dict:
    """Ours: each trajectory submits its next action to one shared elastic pool when its agent reaches it;
    while an agent generates, the pool's workers serve other trajectories' actions (or retire when idle)."""
    pool = ActionPool(settings)
    pool.wait_ready()  # warm at min_workers, as between micro-batches
    start = time.monotonic()

    def run_trajectory(turns: list[tuple[float, Job]]) -> tuple[list[float], list[float], int, int]:
        completions, latencies, failures, hedged = [], [], 0, 0
        for generation, job in turns:
            time.sleep(generation)  # the agent generates its next turn; it holds no worker
            issued = time.monotonic()
            outcome = pool.submit(job).result()
            failures += outcome.status != "ok"
            hedged += outcome.hedged
            completions.append(outcome.finished - start)
            latencies.append(outcome.finished - issued)
        return completions, latencies, failures, hedged

    with ThreadPoolExecutor(len(trajectories)) as threads:
        results = list(threads.map(run_trajectory, trajectories))
    end = time.monotonic()  # the last action is done: every worker counts until now, as the baseline's do
    worker_seconds = pool.worker_seconds(since=start, until=end)
    peak = pool.peak_workers
    pool.shutdown()
    return _summary([c for r in results for c in r[0]], [x for r in results for x in r[1]],
                    sum(r[2] for r in results), worker_seconds, end - start, peak, sum(r[3] for r in results))


def _summary(since_start: list[float], act: list[float], failures: int, worker_seconds: float, elapsed: float,
             peak: int, hedged: int) -> dict:
    values, acts = np.asarray(since_start), np.asarray(act)
    return {"act_mean_s": float(acts.mean()), "act_p99_s": float(np.percentile(acts, 99)),
            "since_start_mean_s": float(values.mean()), "since_start_p99_s": float(np.percentile(values, 99)),
            "worker_s": worker_seconds, "makespan_s": elapsed, "failures": failures, "hedged": hedged,
            "actions": len(act), "peak_workers": peak}


def latency_profile(args: argparse.Namespace) -> dict:
    """Median and p99 of the attempt latency the generator draws (no scheduling, no sleeping)."""
    rng = np.random.default_rng(args.seed)
    samples = args.median * rng.lognormal(0.0, 0.25, 200_000)
    samples[rng.random(samples.size) < args.stall] = args.stall_seconds
    return {"median_s": float(np.median(samples)), "p99_s": float(np.percentile(samples, 99))}


def bar(ours: dict, base: dict) -> tuple[float, float, str]:
    """ours/baseline p99 ACT and worker-seconds, and which branch of the bar holds (equal p99: within 2%, timer
    noise; a lower p99 than the baseline's counts as equal or better)."""
    p99, ws = ours["act_p99_s"] / base["act_p99_s"], ours["worker_s"] / base["worker_s"]
    if p99 <= 0.5 and ws <= 1.0:
        return p99, ws, "holds (half the p99)"
    return p99, ws, "holds (equal p99, >= 40% fewer worker-s)" if p99 <= 1.02 and ws <= 0.6 else "not met"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trajectories", type=int, default=8)
    parser.add_argument("--actions", type=int, default=48, help="actions per trajectory")
    parser.add_argument("--median", type=float, default=0.02, help="median action latency, seconds")
    parser.add_argument("--stall", type=float, default=0.02, help="probability an attempt (or action) stalls")
    parser.add_argument("--stall-seconds", type=float, default=1.0)
    parser.add_argument("--stall-kind", nargs="+", choices=["transient", "intrinsic"],
                        default=["transient", "intrinsic"], help="stalls per attempt (transient) or per action")
    parser.add_argument("--fail", type=float, default=0.05, help="share of actions that raise")
    parser.add_argument("--timeout", type=float, default=5.0, help="per-action timeout, seconds")
    parser.add_argument("--retries", type=int, default=2)
    parser.add_argument("--hedge-after", type=float, default=None,
                        help="the pool hedges an attempt still running after this many seconds (default: off)")
    parser.add_argument("--generation-seconds", type=float, default=0.2,
                        help="median agent generation time before each action (the baseline holds its sandbox)")
    parser.add_argument("--min-workers", type=int, default=1)
    parser.add_argument("--max-workers", type=int, default=8)
    parser.add_argument("--actions-per-worker", type=int, default=1)
    parser.add_argument("--spare-workers", type=int, default=0, help="idle pool workers kept ready beyond the queue")
    parser.add_argument("--idle-grace", type=float, default=0.3, help="seconds a pool worker idles before it retires")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    profile = latency_profile(args)
    print(f"attempt latency: median {profile['median_s'] * 1e3:.1f} ms, p99 {profile['p99_s'] * 1e3:.0f} ms "
          f"({profile['p99_s'] / profile['median_s']:.0f}x); {args.fail:.0%} of actions fail")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    settings = PoolSettings(min_workers=args.min_workers, max_workers=args.max_workers,
                            actions_per_worker=args.actions_per_worker, timeout_s=args.timeout,
                            retries=args.retries, num_cpus=0, idle_grace_s=args.idle_grace,
                            spare_workers=args.spare_workers)
    schedulers = [("per-trajectory", per_trajectory, settings),
                  ("action-level", action_level, settings.model_copy(update={"hedge_after_s": args.hedge_after}))]
    if args.hedge_after is not None:
        schedulers.append(("action-level, no hedge", action_level, settings))
    rows = []
    for kind in args.stall_kind:
        for round_ in range(args.rounds):
            first = round_ % len(schedulers)  # rotate which goes first, so machine noise hits all alike
            for name, scheduler, pool_settings in schedulers[first:] + schedulers[:first]:
                with tempfile.TemporaryDirectory(prefix="attempts-") as directory:
                    result = scheduler(make_jobs(args, round_, kind, directory), pool_settings)
                rows.append(r := {"stall_kind": kind, "round": round_, "scheduler": name, **result})
                print(f"{kind} round {round_} {name:22s} ACT mean {r['act_mean_s']:.3f} s p99 {r['act_p99_s']:.3f} s"
                      f"  since start mean {r['since_start_mean_s']:.3f} s p99 {r['since_start_p99_s']:.3f} s  "
                      f"worker-s {r['worker_s']:.1f}  makespan {r['makespan_s']:.2f} s  failures {r['failures']}/"
                      f"{r['actions']}  hedged {r['hedged']}  peak workers {r['peak_workers']}")
    ray.shutdown()
    for kind in args.stall_kind:
        base = {r["round"]: r for r in rows if r["stall_kind"] == kind and r["scheduler"] == "per-trajectory"}
        for name, *_ in schedulers[1:]:
            for ours in (r for r in rows if r["stall_kind"] == kind and r["scheduler"] == name):
                p99, ws, verdict = bar(ours, base[ours["round"]])
                print(f"{kind} round {ours['round']}: {name}/per-trajectory p99 ACT {p99:.2f}x, worker-s {ws:.2f}x "
                      f"-> bar {verdict}")
    print(json.dumps({"profile": profile, "rows": rows}))


if __name__ == "__main__":
    main()
