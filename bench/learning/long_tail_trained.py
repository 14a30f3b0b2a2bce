"""Benchmark: are slow rollouts starved (issue 73.4)? The long-tail relay (bench/planner/planner.py: three turns, every
environment reply a lognormal delay, median 10 ms, sigma 1) at staleness 1; per decile of an episode's rollout time
(its first turn's start to its last turn's end), the share of its episodes that training used: every turn scored
``ok`` and none dropped by over-sampling. Discard-and-requeue designs drop a slow episode once its policy is older
than the bound; this orchestrator gates sampling instead, so the share should not fall with the decile.

    .venv/bin/python -m bench.learning.long_tail_trained --steps 8 --out /tmp/long-tail-trained.json
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import numpy as np

from bench.launch import launch
from bench.planner.planner import base_config  # it registers the long-tail relay


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--staleness", type=int, default=1)
    parser.add_argument("--work", type=Path, default=Path("/tmp/marl-bench-long-tail"))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    import ray

    from marl_pipeline.config import parse_config
    from marl_pipeline.stages.episodes import DROPPED
    from marl_pipeline.store import ExperienceStore

    shutil.rmtree(args.work, ignore_errors=True)
    data = base_config("longtail")
    data.update(store=str(args.work / "store"), run="longtail")
    data["pipeline"].update(steps=args.steps, staleness=args.staleness)
    config = parse_config(data)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        launch(config)
    finally:
        ray.shutdown()
    store = ExperienceStore(config.store)
    turns = store.read_stage(config.run, "rollouts", columns=["step", "micro_batch", "episode", "sample_id", "status",
                                                               "rollout_start", "rollout_end"]).to_pylist()
    scored = {row["sample_id"]: row["status"] for row in
              store.read_stage(config.run, "rewards", columns=["sample_id", "status"]).to_pylist()}
    episodes: dict[tuple, dict] = {}
    for row in turns:
        episode = episodes.setdefault((row["step"], row["micro_batch"], row["episode"]),
                                      {"start": row["rollout_start"], "end": row["rollout_end"], "trained": True})
        episode["start"], episode["end"] = min(episode["start"], row["rollout_start"]), max(episode["end"],
                                                                                               row["rollout_end"])
        episode["trained"] &= row["status"] != DROPPED and scored.get(row["sample_id"]) == "ok"
    seconds = np.array([(e["end"] - e["start"]).total_seconds() for e in episodes.values()])
    trained = np.array([e["trained"] for e in episodes.values()])
    edges = np.quantile(seconds, np.linspace(0, 1, 11))
    deciles = np.clip(np.searchsorted(edges, seconds, side="right") - 1, 0, 9)
    rows = [{"decile": d + 1, "episodes": int((deciles == d).sum()),
             "seconds": [round(float(edges[d]), 3), round(float(edges[d + 1]), 3)],
             "trained_share": round(float(trained[deciles == d].mean()), 4) if (deciles == d).any() else None}
            for d in range(10)]
    for row in rows:
        print(json.dumps(row))
    print(f"{len(episodes)} episodes, {int(trained.sum())} trained on ({trained.mean():.4f})")
    if args.out:
        args.out.write_text(json.dumps({"staleness": args.staleness, "steps": args.steps, "deciles": rows}, indent=2))


if __name__ == "__main__":
    main()
