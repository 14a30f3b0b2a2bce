"""Benchmark: synchronous pipeline vs streaming (staleness 0) vs streaming (staleness 1), in one run.

Real vLLM rollout engines, real torch trainers, real Ray; the environment is the demo's with an
I/O-bound action latency per episode (a tool call or sandbox round trip, modelled as a sleep that
holds no CPU). Each mode trains the same seeded experiment from the same base policies.

    .venv/bin/python -m bench.pipeline.pipeline [--steps 6] [--action-latency 0.004] [--out bench/results]

Prints a table (step time, episodes/s, busy fraction per resource, pipeline efficiency, orchestrator
overhead) and writes results.json and one stage-activity PNG per mode under --out.
"""

from __future__ import annotations

import argparse
import copy
import json
import shutil
import time
from pathlib import Path

import yaml

from assets.plots import activity_png
from bench.launch import launch
from environments.arithmetic import ArithmeticCheck, ArithmeticOptions
from marl_pipeline.environment import register_environment
from marl_pipeline.run.pipeline_metrics import (
    orchestrator_overhead,
    pipeline_report,
    timeline_from_events,
)

ROOT = Path(__file__).resolve().parents[2]


class SlowOptions(ArithmeticOptions):
    action_latency_s: float = 0.004
    """Seconds each episode's action execution waits on I/O."""


@register_environment
class SlowArithmetic:
    """The demo environment, whose action execution waits on I/O (composition, not inheritance)."""

    name = "slow_arithmetic"
    turn_order = ArithmeticCheck.turn_order
    Options = SlowOptions

    def __init__(self, options: SlowOptions) -> None:
        self.inner = ArithmeticCheck(ArithmeticOptions(**options.model_dump(exclude={"action_latency_s"})))
        self.latency = options.action_latency_s

    def execute(self, task, transcript):
        time.sleep(self.latency)
        return self.inner.execute(task, transcript)

    def __getattr__(self, name):
        return getattr(self.inner, name)


MODES = {
    "synchronous": {"mode": "synchronous", "staleness": 0},
    "streaming_s0": {"mode": "streaming", "staleness": 0},
    "streaming_s1": {"mode": "streaming", "staleness": 1},
}


def experiment(mode: dict, store: Path, steps: int, latency: float) -> dict:
    data = yaml.safe_load((ROOT / "configs" / "demo.yaml").read_text())
    data = copy.deepcopy(data)
    data.update(run="bench", store=str(store))
    data["environment"] = {"name": "slow_arithmetic", "options": {**data["environment"].get("options", {}),
                                                                   "action_latency_s": latency}}
    data["pipeline"].update(steps=steps, environment_concurrency=2, **mode)
    return data


def run_mode(name: str, data: dict, base: Path) -> dict:
    from marl_pipeline.config import parse_config
    from marl_pipeline.run.events import RunFinished

    store = Path(data["store"])
    shutil.rmtree(store, ignore_errors=True)
    shutil.copytree(base, store)  # identical base policies for every mode
    config = parse_config(data, source=name)
    events: list = []
    launch(config, events.append)
    finished = events[-1]
    assert isinstance(finished, RunFinished), finished
    timeline = timeline_from_events(events)
    spans, started = timeline.spans, finished.started
    report = pipeline_report(spans, steps=config.pipeline.steps, episodes=timeline.episodes, tokens=timeline.tokens,
                             started=started, ended=finished.ended)
    overhead = orchestrator_overhead(spans, {"environment_results": config.pipeline.environment_concurrency},
                                     synchronous=config.pipeline.mode == "synchronous")
    report["overhead_per_micro_batch_s"] = round(overhead, 4)
    report["overhead_share_of_step"] = round(overhead * config.pipeline.micro_batches_per_step
                                             / report["step_time_s"], 4)
    report["_png"] = activity_png(spans, started, title=f"stage activity: {name}")
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--action-latency", type=float, default=0.004, help="seconds per episode's action")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--work", type=Path, default=Path("/tmp/marl-bench-pipeline"))
    args = parser.parse_args()

    import ray

    from marl_pipeline.bootstrap.policies import prepare_base_policies
    from marl_pipeline.config import parse_config
    from marl_pipeline.environment import build_environment
    from marl_pipeline.store import ExperienceStore

    ray.init(include_dashboard=False, log_to_driver=False)
    shutil.rmtree(args.work, ignore_errors=True)
    base_data = experiment(MODES["synchronous"], args.work / "base", args.steps, args.action_latency)
    base_config = parse_config(base_data)
    prepare_base_policies(base_config, build_environment(base_config.environment.name,
                                                         base_config.environment.options),
                          ExperienceStore(base_config.store))
    args.out.mkdir(parents=True, exist_ok=True)
    results = {}
    for name, mode in MODES.items():
        report = run_mode(name, experiment(mode, args.work / name, args.steps, args.action_latency),
                          args.work / "base")
        (args.out / f"pipeline_{name}.png").write_bytes(report.pop("_png"))
        results[name] = report
        print(name, json.dumps(report), flush=True)
    ray.shutdown()
    baseline = results["synchronous"]["episodes_per_s"]
    for report in results.values():
        report["speedup_vs_synchronous"] = round(report["episodes_per_s"] / baseline, 3)
    (args.out / "pipeline.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                        "results": results}, indent=2))
    columns = ["step_time_s", "episodes_per_s", "speedup_vs_synchronous", "pipeline_efficiency",
               "busy_fraction/engines", "busy_fraction/environment", "busy_fraction/reward",
               "busy_fraction/trainers", "overhead_per_micro_batch_s", "overhead_share_of_step"]
    print("| mode | " + " | ".join(columns) + " |")
    print("|---" * (len(columns) + 1) + "|")
    for name, report in results.items():
        print(f"| {name} | " + " | ".join(str(report.get(c, "")) for c in columns) + " |")


if __name__ == "__main__":
    main()
