"""The held-out evaluation of stored runs as a table against training time, and its plot.

    PYTHONPATH=$PWD .venv/bin/python -m bench.learning.evaluation_report STORE RUN [--plot FILE.png] [--label NAME]
        [--since 2026-11-24T02:20:00Z]

For the real-model benchmark (BENCHMARKS.md, "SmolLM2 solver and verifier"): each evaluated policy version with
its minutes of training, counted from the first rollout of step 0 (engines and trainers already started) to the
commit of the update that made the version, and each agent's headline metrics. ``--since`` (the time the command
started) adds the minutes from then, which count a warm-up before version 0 and the set-up.
Reads the store only; the run may still be going.
"""

from __future__ import annotations

import argparse
from datetime import datetime
from pathlib import Path

import pyarrow.compute as pc
import pyarrow.dataset as ds

from assets.plots import evaluation_png
from marl_pipeline.config import StoreConfig
from marl_pipeline.run.evaluations import evaluation_history
from marl_pipeline.store import ExperienceStore

COLUMNS = {"solver": ["accuracy", "top_answer_share"],
           "verifier": ["balanced_accuracy", "true_positive_rate", "true_negative_rate", "working_accuracy",
                        "agreement"]}


def _stage(store_dir: str, run: str, name: str, column: str):
    return ds.dataset(Path(store_dir, f"run={run}", f"stage={name}"), format="parquet",
                      partitioning="hive").to_table(columns=["step", column])


def version_times(store_dir: str, run: str) -> dict[int, float]:
    """Each policy version's POSIX time: version v is ready when every agent's update of step v - 1 has committed
    (the ``policy_updates`` stage's end times)."""
    updates = _stage(store_dir, run, "policy_updates", "stage_ended").group_by("step").aggregate(
        [("stage_ended", "max")])
    return {step + 1: ended.timestamp()
            for step, ended in zip(updates["step"].to_pylist(), updates["stage_ended_max"].to_pylist())}


def step0_started(store_dir: str, run: str) -> float:
    """POSIX time of step 0's first rollout: engines and trainers are up, training begins."""
    rollouts = _stage(store_dir, run, "rollouts", "stage_started")
    return pc.min(rollouts.filter(pc.equal(rollouts["step"], 0))["stage_started"]).as_py().timestamp()


def minutes_since(start: float, times: dict[int, float]) -> dict[int, float]:
    """Each version's minutes after ``start`` (POSIX time)."""
    return {version: (ended - start) / 60 for version, ended in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("store", help="a local store directory")
    parser.add_argument("run")
    parser.add_argument("--plot", type=Path, help="write the evaluation plot here (PNG)")
    parser.add_argument("--label", default=None, help="the plot's title (default: the run)")
    parser.add_argument("--since", type=datetime.fromisoformat, default=None,
                        help="when the command started (ISO 8601, with its zone): adds minutes since then")
    args = parser.parse_args()
    store = ExperienceStore(StoreConfig(uri=args.store))
    history = evaluation_history(store, args.run)
    started = step0_started(args.store, args.run)
    times = version_times(args.store, args.run) | {0: started}  # version 0 is ready when step 0 starts
    minutes = minutes_since(started, times)
    agents = sorted({agent for metrics in history.values() for agent in metrics})
    since = {}
    if args.since is not None:
        if args.since.tzinfo is None:
            parser.error(f"--since {args.since.isoformat()}: give the zone, e.g. 2026-11-24T02:20:00Z")
        since = minutes_since(args.since.timestamp(), times)
    header = ["version", "training minutes"] + (["minutes since --since"] if since else [])
    header += [f"{a} {m}" for a in agents for m in COLUMNS.get(a, [])]
    print("| " + " | ".join(header) + " |")
    print("| " + " | ".join(["---"] + ["---:"] * (len(header) - 1)) + " |")
    for version, metrics in sorted(history.items()):
        cells = [str(version), f"{minutes[version]:.1f}" if version in minutes else "?"]
        cells += [f"{since[version]:.1f}" if version in since else "?"] if since else []
        cells += [f"{metrics.get(a, {}).get(m, float('nan')):.3f}" for a in agents for m in COLUMNS.get(a, [])]
        print("| " + " | ".join(cells) + " |")
    if args.plot:
        args.plot.write_bytes(evaluation_png(history, title=args.label or args.run))
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
