"""Benchmark: which of a verifier's own settings keep it from a base-rate collapse (issue 72.6). The demo's team on
a task where "no" is the right verdict on most prompts (``decoy_share`` 0.7, ``right_share`` 0.1: the verifier is
shown a wrong decoy on 70% of the tasks), paid for right verdicts. An arm is the verifier's own settings
(``algorithm``, ``trainer``) and the environment's options (``environment``); the default arms: nothing, an entropy
bonus, a KL penalty to version 0, a smaller step, the advantage estimators, and a class-balanced reward
(``no_weight`` 0.4: a right "no" earns 0.4, a right "yes" 1, about the inverse ratio of their shares) under each
estimator. Per arm and seed: the step where the health rules first saw a collapse (``may be collapsing``), the
verifier's top-answer share and the reward its top answer earned at the end, and its held-out balanced accuracy at
version 0 and at the last version. Each seed's version 0 is made once and shared by its arms; the launches run one
after another in this process, on one local Ray of 2 CPUs:

    .venv/bin/python -m bench.learning.collapse_remedies --seeds 0 1 --steps 30 --out /tmp/collapse-remedies.json
    .venv/bin/python -m bench.learning.collapse_remedies --seeds 0 1 --steps 30 \
        --arm 'rloo, balanced={"algorithm": {"advantage": {"type": "rloo"}}, "environment": {"no_weight": 0.4}}' \
        --out /tmp/collapse-rloo.json
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import yaml

from bench.launch import launch

ROOT = Path(__file__).resolve().parents[2]
BALANCED = {"environment": {"no_weight": 0.4}}
ARMS = {"nothing": {}, "entropy 0.1": {"algorithm": {"entropy_coef": 0.1}}, "kl 1": {"algorithm": {"kl_coef": 1.0}},
        "lr 2.5e-4": {"trainer": {"lr": 2.5e-4}}, "balanced": BALANCED,
        **{f"{estimator}{name}": {"algorithm": {"advantage": {"type": estimator}}, **extra}
           for estimator in ("dr_grpo", "agent_normalized") for name, extra in (("", {}), (", balanced", BALANCED))}}
SETTINGS = ("algorithm", "trainer", "environment")
TASK = {"decoy_share": 0.7, "right_share": 0.1}


def experiment(seed: int, steps: int, store: Path) -> dict:
    data = yaml.safe_load((ROOT / "configs" / "demo.yaml").read_text())
    data.update(seed=seed, store=str(store))
    data["environment"]["options"].update(TASK)
    data["pipeline"].update(steps=steps)
    data["evaluation"] = {"every": steps}
    for agent in data["agents"].values():
        agent["trainer"]["lr_decay_steps"] = steps
    return data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--work", type=Path, default=Path("/tmp/marl-bench-collapse"))
    parser.add_argument("--out", type=Path)
    parser.add_argument("--arm", action="append", default=[], metavar="NAME=JSON",
                        help="an arm of your own: its name and the verifier's settings, keys of "
                             f"{', '.join(SETTINGS)} (default: the nine)")
    args = parser.parse_args()
    arms = dict(ARMS) if not args.arm else {name: json.loads(own) for name, own in
                                             (arm.split("=", 1) for arm in args.arm)}
    for name, own in arms.items():
        if not isinstance(own, dict) or set(own) - set(SETTINGS):
            parser.error(f"arm {name!r}: {own} is not an object with keys of {', '.join(SETTINGS)}")
    import shutil

    import ray

    from marl_pipeline.bootstrap.policies import prepare_base_policies
    from marl_pipeline.config import parse_config
    from marl_pipeline.environment import build_environment
    from marl_pipeline.run.evaluations import evaluation_history
    from marl_pipeline.run.events import StepFinished
    from marl_pipeline.stages.evaluation import headline_metric
    from marl_pipeline.stages.health import COLLAPSING
    from marl_pipeline.store import ExperienceStore

    shutil.rmtree(args.work, ignore_errors=True)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    rows = []
    for seed in args.seeds:
        base = parse_config(experiment(seed, args.steps, args.work / f"seed{seed}-base"))
        env = build_environment(base.environment.name, base.environment.options)
        made = {p.agent: str(p.path) for p in prepare_base_policies(base, env, ExperienceStore(base.store), True)}
        for arm, own in arms.items():
            data = experiment(seed, args.steps, args.work / f"seed{seed}-{arm.replace(' ', '-')}")
            for name, agent in data["agents"].items():
                agent.update(model=made[name], warmup={"steps": 0})
            verifier = data["agents"]["verifier"]
            verifier["algorithm"] = copy.deepcopy(own.get("algorithm", {}))
            verifier["trainer"].update(own.get("trainer", {}))
            data["environment"]["options"].update(own.get("environment", {}))
            config = parse_config(data)
            started = time.perf_counter()
            events: list = []
            launch(config, events.append)
            steps = [event for event in events if isinstance(event, StepFinished)]
            history = evaluation_history(ExperienceStore(config.store), config.run)
            first, last = min(history), max(history)
            collapsed = next((event.step for event in steps if any(
                COLLAPSING in w and w.startswith("verifier") for w in event.warnings)), None)
            end = steps[-1].health["verifier"]
            row = {"seed": seed, "arm": arm, "collapse_step": collapsed,
                   "top_answer_share": round(end["top_answer_share"], 3),
                   "top_answer_reward": round(end["top_answer_reward"], 3),
                   "balanced_accuracy": [round(headline_metric(history[v]["verifier"])[1], 3) for v in (first, last)],
                   "solver_accuracy": [round(headline_metric(history[v]["solver"])[1], 3) for v in (first, last)],
                   "seconds": round(time.perf_counter() - started)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    ray.shutdown()
    if args.out:
        args.out.write_text(json.dumps({"task": TASK, "steps": args.steps, "arms": arms, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
