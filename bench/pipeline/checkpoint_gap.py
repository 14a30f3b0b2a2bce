"""Benchmark: what stands between a step's last update and the next step's first rollout, from a run's store.

For each step s: the gap from the end of its last ``policy_updates`` partition to the start of step s + 1's first
``rollouts`` partition (at staleness 0 rollout waits for the new version), beside each new version's engine sync
(``sync_seconds`` of its ``timing.json``) and the time from the sync to its commit (optimizer step excluded).

    .venv/bin/python -m bench.pipeline.checkpoint_gap STORE RUN
"""

from __future__ import annotations

import argparse
import json

import pyarrow.compute as pc

from marl_pipeline.config import StoreConfig
from marl_pipeline.store import ExperienceStore


def _times(store: ExperienceStore, run: str, stage: str, column: str, reduce) -> dict[int, float]:
    table = store.read_stage(run, stage, columns=["step", column])
    by_step = table.group_by("step").aggregate([(column, reduce)])
    seconds = pc.divide(pc.cast(by_step.column(f"{column}_{reduce}"), "int64"), 1e6).to_pylist()
    return dict(zip(by_step.column("step").to_pylist(), seconds))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("store")
    parser.add_argument("run")
    args = parser.parse_args()
    store = ExperienceStore(StoreConfig(uri=args.store))
    trained = _times(store, args.run, "policy_updates", "stage_ended", "max")
    sampled = _times(store, args.run, "rollouts", "stage_started", "min")
    print("| step | last update -> next first rollout (s) | agent | sync (s) | sync end -> commit (s) |")
    print("| --- | --- | --- | --- | --- |")
    for step in sorted(trained):
        if step + 1 not in sampled:
            continue
        gap = sampled[step + 1] - trained[step]
        for agent in store.checkpoints.agents(args.run):
            raw = store.checkpoints.read_file(args.run, agent, step + 1, "timing.json")
            if raw is None:  # pruned by retention
                continue
            record = json.loads(raw)
            sync = record.get("sync_seconds")
            after = None if sync is None else record["ended"] - record["started"] - sync
            print(f"| {step} | {gap:.3f} | {agent} | {'-' if sync is None else f'{sync:.3f}'} | "
                  f"{'-' if after is None else f'{after:.3f}'} |")


if __name__ == "__main__":
    main()
