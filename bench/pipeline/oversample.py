"""Benchmark: over-sampling (``pipeline.rollout.oversample``) against hung environments, in one run.

Three launches of the demo, the same seeded experiment from the same base policies, real vLLM engines, torch trainers
and Ray: fault-free; with a share of the episodes hanging in their first environment reply past the time limit
(``pipeline.rollout.episode_timeout_s``), without over-sampling; the same with ``oversample`` extra episodes per
group. The hang is the environment's (``hanging_arithmetic``, below: ``hang_fraction``, ``hang_s``).

    .venv/bin/python -m bench.pipeline.oversample [--steps 20] [--hang-fraction 0.1] [--hang-s 5] [--oversample 2] \
        [--timeout 3]

Prints, per launch, the mean step time (the first step left out: it includes the engines' first compilation), the
groups whose n episodes all finished and the episodes per group trained on, and writes oversample.json under --out.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import shutil
import statistics
import time
import zlib
from pathlib import Path

import yaml

from bench.launch import launch
from environments.arithmetic import ArithmeticCheck, ArithmeticOptions
from marl_pipeline.environment import register_environment

ROOT = Path(__file__).resolve().parents[2]


class HangOptions(ArithmeticOptions):
    hang_fraction: float = 0.0
    """Share of each group's episodes whose first reply hangs, spread evenly over its trajectories."""
    hang_s: float = 5.0
    """How long a hung reply takes (set it past ``episode_timeout_s``)."""


def hangs(task_id: str, trajectory: int, fraction: float) -> bool:
    """Whether the episode hangs: of any m consecutive trajectories of a task, floor or ceil of m x ``fraction`` do,
    from an offset drawn from the task's id; a pure function of (task, trajectory), so the same episodes hang in
    every launch and a group's first n hang as often with over-sampling as without."""
    offset = zlib.crc32(task_id.encode()) / 2**32
    return math.floor((trajectory + 1) * fraction + offset) > math.floor(trajectory * fraction + offset)


@register_environment
class HangingArithmetic(ArithmeticCheck):
    """The demo environment, where chosen episodes' first reply (``observe``) hangs."""

    name = "hanging_arithmetic"
    Options = HangOptions

    def __init__(self, options: HangOptions) -> None:
        super().__init__(options)
        self.fraction, self.hang_s = options.hang_fraction, options.hang_s

    def episode_task(self, task, trajectory):
        return {**task, "trajectory": trajectory}

    def observe(self, role, task, transcript):
        if len(transcript) == 1 and hangs(task["id"], task["trajectory"], self.fraction):
            time.sleep(self.hang_s)
        return None


def experiment(store: Path, steps: int, hang_fraction: float, oversample: int | float, timeout: float) -> dict:
    data = copy.deepcopy(yaml.safe_load((ROOT / "configs" / "demo.yaml").read_text()))
    data.update(run="bench", store=str(store))
    data.pop("evaluation", None)
    data["environment"] = {"name": "hanging_arithmetic", "options": {**data["environment"].get("options", {}),
                                                                      "hang_fraction": hang_fraction}}
    # A hung reply holds its driver thread: enough threads that the hung ones never queue the others.
    data["pipeline"].update(steps=steps, rollout={"episode_timeout_s": timeout, "observe_threads": 256,
                                                  "oversample": oversample})
    return data


def run_launch(name: str, data: dict, base: Path) -> dict:
    from marl_pipeline.config import parse_config
    from marl_pipeline.run.events import RunFinished, StepFinished
    from marl_pipeline.store import ExperienceStore

    store = Path(data["store"])
    shutil.rmtree(store, ignore_errors=True)
    shutil.copytree(base, store)  # identical base policies for every launch
    config = parse_config(data, source=name)
    events: list = []
    launch(config, events.append)
    assert isinstance(events[-1], RunFinished), events[-1]
    seconds = [event.seconds for event in events if isinstance(event, StepFinished)][1:]
    n = config.pipeline.samples_per_prompt
    rewards = ExperienceStore(config.store).read_stage(config.run, "rewards",
                                                       columns=["step", "group_id", "episode", "status"])
    trained: dict[str, set[int]] = {}  # per group: its episodes trained on (reward status ok)
    for row in rewards.to_pylist():
        episodes = trained.setdefault(row["group_id"], set())
        if row["status"] == "ok":
            episodes.add(row["episode"])
    sizes = [len(episodes) for episodes in trained.values()]
    health = ExperienceStore(config.store).read_stage(config.run, "health", columns=["agent", "dropped_episodes"])
    dropped = sum(row["dropped_episodes"] or 0 for row in health.to_pylist() if row["agent"] == "solver")
    return {"step_time_s": round(statistics.mean(seconds), 3), "step_times_s": [round(s, 3) for s in seconds],
            "groups": len(sizes), "complete_groups": sum(size == n for size in sizes),
            "mean_group_size": round(statistics.mean(sizes), 3), "min_group_size": min(sizes), "n": n,
            "dropped_episodes": dropped}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--hang-fraction", type=float, default=0.1)
    parser.add_argument("--hang-s", type=float, default=5.0)
    parser.add_argument("--oversample", type=lambda text: float(text) if "." in text else int(text), default=2,
                        help="extra episodes per group: an int, or a fraction in (0, 1] of n (with a point)")
    parser.add_argument("--timeout", type=float, default=3.0, help="pipeline.rollout.episode_timeout_s")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--work", type=Path, default=Path("/tmp/marl-bench-oversample"))
    args = parser.parse_args()

    import ray

    from marl_pipeline.bootstrap.policies import prepare_base_policies
    from marl_pipeline.config import parse_config
    from marl_pipeline.environment import build_environment
    from marl_pipeline.store import ExperienceStore

    ray.init(include_dashboard=False, log_to_driver=False)
    shutil.rmtree(args.work, ignore_errors=True)
    base_config = parse_config(experiment(args.work / "base", args.steps, 0.0, 0, args.timeout))
    prepare_base_policies(base_config, build_environment(base_config.environment.name,
                                                         base_config.environment.options),
                          ExperienceStore(base_config.store))
    launches = {"fault_free": (0.0, 0), "hanging": (args.hang_fraction, 0),
                "hanging_oversample": (args.hang_fraction, args.oversample)}
    results = {}
    for name, (fraction, extra) in launches.items():
        data = experiment(args.work / name, args.steps, fraction, extra, args.timeout)
        data["environment"]["options"]["hang_s"] = args.hang_s
        results[name] = run_launch(name, data, args.work / "base")
        print(name, json.dumps(results[name]), flush=True)
    ray.shutdown()
    baseline = results["fault_free"]["step_time_s"]
    for report in results.values():
        report["vs_fault_free"] = round(report["step_time_s"] / baseline, 3)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "oversample.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                          "results": results}, indent=2))
    columns = ["step_time_s", "vs_fault_free", "complete_groups", "groups", "mean_group_size", "min_group_size",
               "dropped_episodes"]
    print("| launch | " + " | ".join(columns) + " |")
    print("|---" * (len(columns) + 1) + "|")
    for name, report in results.items():
        print(f"| {name} | " + " | ".join(str(report[c]) for c in columns) + " |")


if __name__ == "__main__":
    main()
