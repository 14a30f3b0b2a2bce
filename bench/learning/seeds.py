"""Benchmark: what a config's training does for each agent over several seeds (issue 31.3): each agent's held-out
headline metric (``stages.evaluation.headline_metric``) at version 0 and at the last version, its gain, and the
mean and the minimum of the gains over the seeds. Never one run or a mean reward.

Each seed is one ``marl train`` (the CLI, as a user runs it) of CONFIG with ``seed: N``, its own store and Dagster
home, one after the other (two runs at once on 2 cores would change both):

    .venv/bin/python -m bench.learning.seeds configs/demo.yaml --seeds 0 1 2 --out /tmp/seeds.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

from bench.launch import launch_cli
from bench.pipeline.bound import config_arguments


def train(data: dict, seed: int, work: Path) -> dict[int, dict[str, dict[str, float]]]:
    """One seed's run; its evaluation history (version -> agent -> metrics)."""
    from marl_pipeline.run.evaluations import evaluation_history
    from marl_pipeline.store import ExperienceStore

    where = work / f"seed{seed}"
    seconds = launch_cli({**data, "seed": seed, "store": str(where / "store")}, where)
    print(f"seed {seed}: {seconds:.0f} s", flush=True)
    return evaluation_history(ExperienceStore(str(where / "store")), data["run"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", type=Path)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args, data = config_arguments(parser, Path("/tmp/marl-bench-seeds"))
    import shutil

    from marl_pipeline.stages.evaluation import headline_metric

    shutil.rmtree(args.work, ignore_errors=True)
    histories = {seed: train(data, seed, args.work) for seed in args.seeds}
    rows = []
    for seed, history in histories.items():
        first, last = min(history), max(history)
        for agent, metrics in history[first].items():
            name, before = headline_metric(metrics)
            after = headline_metric(history[last][agent])[1]
            by_version = {version: round(headline_metric(m[agent])[1], 3) for version, m in history.items()}
            rows.append({"seed": seed, "agent": agent, "metric": name, "first_version": first,
                         "last_version": last, "before": round(before, 3), "after": round(after, 3),
                         "gain": round(after - before, 3), "by_version": by_version})
    from marl_pipeline.policy.precision import cpu_name

    cpu = cpu_name()
    print(f"{args.config} {args.set}: {os.cpu_count()} cores, {cpu}")
    print("| agent | metric | seed | by version | gain |")
    print("| --- | --- | ---: | --- | ---: |")
    for row in rows:
        versions = ", ".join(f"v{v} {value}" for v, value in row["by_version"].items())
        print(f"| {row['agent']} | {row['metric']} | {row['seed']} | {versions} | {row['gain']:+.3f} |")
    summary = {}
    for agent in dict.fromkeys(row["agent"] for row in rows):
        gains = [row["gain"] for row in rows if row["agent"] == agent]
        summary[agent] = {"mean_gain": round(statistics.mean(gains), 3), "min_gain": round(min(gains), 3)}
        print(f"{agent}: gain mean {summary[agent]['mean_gain']:+.3f}, min {summary[agent]['min_gain']:+.3f} "
              f"over seeds {args.seeds}")
    team = [(seed, history) for seed, history in histories.items() if any("team" in m for m in history.values())]
    if team:  # the team measured as a team (stages/team.py): its answer against the answering role alone
        print("\n| seed | version | team's answer | first sample alone | majority vote alone | best of n |")
        print("| ---: | ---: | ---: | ---: | ---: | ---: |")
        for seed, history in team:
            for version, metrics in history.items():
                if (t := metrics.get("team")) is not None:
                    print(f"| {seed} | {version} | {t['team_answer']:.3f} | {t['first_sample']:.3f} | "
                          f"{t['majority_vote']:.3f} | {t['any_sample']:.3f} |")
    if args.out:
        args.out.write_text(json.dumps({"config": str(args.config), "set": args.set, "cpu": cpu, "rows": rows,
                                        "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
