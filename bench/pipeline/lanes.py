"""Lanes against least-outstanding routing, side by side: three agents relaying a colour (bench/planner/planner.py's
``--team trio``), each agent on two engine replicas, at staleness 0 and 1, each configuration launched with
``pipeline.rollout.lanes`` on and off in alternating order (on, off, then off, on, ...).

    .venv/bin/python -m bench.pipeline.lanes --work /tmp/lanes --steps 20 --rounds 2

Per launch: the mean step seconds over steps 1.. (``StepFinished.seconds``), the engines' vLLM steps a training step
and the sequences each held on average (their ``timing.json``: ``engine_steps``, ``engine_step_sequences``, summed
over agents and replicas, from the version after step 1 to the last), and the processes' CPU seconds a step. Nothing
else should run meanwhile.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
from pathlib import Path

from bench.planner import planner  # bench/planner/planner.py: the trio's configurations and one launch

CONFIGURATIONS = ("replicas_2", "staleness_1_replicas_2")


def engine_steps(store, run: str, agents: list[str], steps: int) -> tuple[float, float]:
    """The engines' vLLM steps a training step over steps 2..steps-1, and the sequences a vLLM step held."""
    taken = held = 0
    for agent in agents:
        first, last = (json.loads(store.policy_file(run, agent, version, "timing.json")) for version in (2, steps))
        taken += last["engine_steps"] - first["engine_steps"]
        held += last["engine_step_sequences"] - first["engine_step_sequences"]
    return taken / (steps - 2), held / max(taken, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    import ray

    from marl_pipeline.store import ExperienceStore

    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    base = planner.base_config("trio")
    base["pipeline"]["steps"] = args.steps
    launches = planner.variants(base)
    store_uri = args.work / "store"
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    warm_up = {**launches["streaming"], "pipeline": {**launches["streaming"]["pipeline"], "steps": 2}}
    planner.launch(warm_up, "warm_up", store_uri, None)  # version 0, once, for every launch after
    store = ExperienceStore(str(store_uri))
    rows = []
    for index in range(args.rounds):
        order = (True, False) if index % 2 == 0 else (False, True)
        for name in CONFIGURATIONS:
            for lanes in order:
                data = launches[name]
                data = {**data, "pipeline": {**data["pipeline"],
                                             "rollout": {**data["pipeline"].get("rollout", {}), "lanes": lanes}}}
                run = f"{name}.{'lanes' if lanes else 'least_outstanding'}.round{index + 1}"
                cpu: dict[str, float] = {}
                seconds = planner.launch(data, run, store_uri, "warm_up", cpu)
                steps, sequences = engine_steps(store, run, list(data["agents"]), args.steps)
                rows.append({"configuration": name, "lanes": lanes, "run": run,
                             "step_s": statistics.mean(seconds[1:]), "engine_steps": steps,
                             "sequences_a_step": sequences, "cpu": cpu})
    (args.work / "results.json").write_text(json.dumps(rows, indent=1))
    print("| configuration | routing | s a step (each launch) | engine steps a step | sequences a vLLM step | "
          "engines' CPU s a step | all processes' CPU s a step |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name in CONFIGURATIONS:
        for lanes in (True, False):
            mine = [row for row in rows if row["configuration"] == name and row["lanes"] == lanes]
            each = ", ".join(f"{row['step_s']:.2f}" for row in mine)
            print(f"| {name} | {'lanes' if lanes else 'least outstanding'} | "
                  f"{statistics.mean(row['step_s'] for row in mine):.2f} ({each}) | "
                  f"{statistics.mean(row['engine_steps'] for row in mine):.1f} | "
                  f"{statistics.mean(row['sequences_a_step'] for row in mine):.1f} | "
                  f"{statistics.mean(row['cpu'].get('engines', 0.0) for row in mine):.2f} | "
                  f"{statistics.mean(sum(row['cpu'].values()) for row in mine):.2f} |")


if __name__ == "__main__":
    main()
