"""Fit the planner's crowding exponent (planner/shared_cores.py) on finished runs of bench/planner/planner.py.

The simulation shares a node's cores fairly among the threads that want them; on this 2-core host the launches with most
processes (two replicas an agent, staleness 1) ran slower than that predicts, their trainer calls and turns longer than
the simulated ones while every process computed at once. ``crowding`` charges it: while a node has more threads than
cores, a core-second held does ``(cores / threads) ** crowding`` of its work. This predicts each run's blocks again,
each from the launches it was calibrated from, at each exponent of ``--grid``, and prints per exponent each launch's
error against its measurement (median, max, root mean square, mean): the fit is the exponent of least root mean square,
to give ``bench/planner/planner.py --crowding`` (or write as ``"crowding"`` into a thread profile) before launches that
test it.

    .venv/bin/python -m bench.planner.crowding /tmp/v_pair:pair /tmp/v_trio:trio /tmp/v_longtail:longtail
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def errors(work: Path, team: str, crowding: float) -> list[tuple[str, float, float]]:
    """Each unseen launch of the finished run in ``work``: (run, predicted, measured) mean step seconds, steps 1.."""
    from bench.planner.planner import compare, predicted_again

    results = json.loads((work / "results.json").read_text())
    threads = work / "threads.json"
    predicted = predicted_again(work, team, results, threads if threads.is_file() else None, crowding)
    return [(one["run"], one["predicted"], one["measured"])
            for one in compare(results["plan"], predicted, results["measured"], {}) if one["name"] != "streaming"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", metavar="WORK:TEAM", help="a finished bench/planner/planner.py --work "
                                                                      "directory and its --team")
    parser.add_argument("--grid", type=float, nargs="+", default=[0.0, 0.05, 0.1, 0.15, 0.2])
    parser.add_argument("--out", type=Path, help="also write every launch's prediction at each exponent (JSON)")
    args = parser.parse_args()
    if bad := [crowding for crowding in args.grid if not 0 <= crowding <= 2]:
        parser.error(f"--grid {bad}: each exponent is a number from 0 to 2 (0: no loss beyond the cores)")
    runs = []
    for entry in args.runs:
        work, _, team = entry.rpartition(":")
        if not work or team not in ("pair", "trio", "longtail"):
            parser.error(f"{entry!r}: expected WORK:TEAM with TEAM pair, trio or longtail")
        if not (Path(work) / "results.json").is_file():
            parser.error(f"{work}: no results.json there (a finished bench/planner/planner.py run)")
        runs.append((Path(work), team))
    table, fits = {}, []
    print("| crowding | launches | median error | max | root mean square | mean | within 20% |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for crowding in args.grid:
        rows = [row for work, team in runs for row in errors(work, team, crowding)]
        signed = [(p - m) / m for _, p, m in rows]
        size = [abs(error) for error in signed]
        rms = math.sqrt(statistics.mean(error * error for error in signed))
        fits.append((rms, crowding))
        table[crowding] = rows
        print(f"| {crowding:g} | {len(rows)} | {statistics.median(size):.1%} | {max(size):.1%} | {rms:.1%} | "
              f"{statistics.mean(signed):+.1%} | {sum(error <= 0.2 for error in size)} |", flush=True)
    print(f"fit: crowding {min(fits)[1]:g} (least root mean square error)")
    if args.out:
        args.out.write_text(json.dumps({str(c): rows for c, rows in table.items()}, indent=1))


if __name__ == "__main__":
    main()
