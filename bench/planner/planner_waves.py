"""A turn's wave, measured against simulated, for the launches of a ``bench/planner/planner.py`` run: where a
prediction's step time goes wrong.

    .venv/bin/python -m bench.planner.planner_waves --work /tmp/planner --team trio \
        [--runs staleness_1_replicas_2.round1 ...]

A wave is a micro-batch's turns of one index (the first turns go out together, each later one when its episode's
previous turn came back). For each launch kept in ``<work>/store`` (default: every one but the calibration's), over
steps 1..: the median spread of each turn's wave (its first request sent to its last), the median latency of a turn
(sent to sampled, its environment's reply left out) and the median rollout of a micro-batch (its first request sent
to its last turn sampled), measured from the store and simulated from the calibration's costs (the launches named
``streaming*`` that the bench calibrated from), side by side. Waves that come apart make the engines run more,
smaller steps; the simulation's are what its engines return (planner/simulate.py).
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def measured(store, run: str) -> dict:
    """The run's waves from its stored rollouts: spread and latency by turn, a micro-batch's rollout."""
    from marl_pipeline.planner.costs import epoch_seconds

    rows = store.read_stage(run, "rollouts", columns=["step", "micro_batch", "turn", "rollout_start", "rollout_end",
                                                      "observe_seconds"])
    turns = [(step, mb, turn, start, end - (observed or 0.0)) for step, mb, turn, start, end, observed in zip(
        rows.column("step").to_pylist(), rows.column("micro_batch").to_pylist(), rows.column("turn").to_pylist(),
        epoch_seconds(rows.column("rollout_start")), epoch_seconds(rows.column("rollout_end")),
        rows.column("observe_seconds").to_pylist()) if step >= 1]
    return summary(turns)


def simulated(decisions) -> dict:
    return summary([(d.step, d.micro_batch, d.turn, d.started, d.ended) for d in decisions if d.step >= 1])


def summary(turns: list[tuple[int, int, int, float, float]]) -> dict:
    sent, latency, rollout = defaultdict(list), defaultdict(list), defaultdict(list)
    for step, mb, turn, started, ended in turns:
        sent[(step, mb, turn)].append(started)
        latency[turn].append(ended - started)
        rollout[(step, mb)] += [started, ended]
    spread = defaultdict(list)
    for (_, _, turn), times in sent.items():
        spread[turn].append(max(times) - min(times))
    return {"spread_ms": {turn: 1e3 * statistics.median(v) for turn, v in sorted(spread.items())},
            "latency_ms": {turn: 1e3 * statistics.median(v) for turn, v in sorted(latency.items())},
            "rollout_s": statistics.median(max(v) - min(v) for v in rollout.values())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, required=True, help="A bench/planner/planner.py run's --work.")
    parser.add_argument("--team", choices=("pair", "trio", "longtail"), default="pair")
    parser.add_argument("--runs", nargs="*", help="Launches to compare (default: every one but the calibration's).")
    args = parser.parse_args()

    from bench.planner.planner import (  # bench/planner/planner.py; base_config registers the team
        NODES,
        base_config,
        calibration_runs,
    )
    from marl_pipeline.config import parse_config
    from marl_pipeline.planner.plan import calibration, predict
    from marl_pipeline.run.launches import launch_history
    from marl_pipeline.store import ExperienceStore

    base_config(args.team)
    store = ExperienceStore(str(args.work / "store"))
    launches = sorted(path.name.removeprefix("run=") for path in (args.work / "store").glob("run=*"))
    calibrations = calibration_runs(launches)
    costs = calibration(store, calibrations, NODES)
    print("| launch | wave spread ms by turn: measured, simulated | turn latency ms | micro-batch rollout s |")
    print("| --- | --- | --- | --- |")
    for run in args.runs or [run for run in launches if run not in calibrations]:
        history, configs = launch_history(store, run)
        config = parse_config(configs[history[-1]["config"]])  # as it ran
        real = measured(store, run)
        sim = simulated(predict(config, NODES, costs, config.pipeline.steps)[1].decisions)
        print(f"| {run} | " + " | ".join(", ".join(f"t{turn} {real[key][turn]:.0f}/{sim[key].get(turn, 0):.0f}"
                                                   for turn in real[key]) for key in ("spread_ms", "latency_ms"))
              + f" | {real['rollout_s']:.3f}/{sim['rollout_s']:.3f} |", flush=True)


if __name__ == "__main__":
    main()
