"""Benchmark: what a team of separate policies adds over one agent and over one shared policy (issue 72.4), AT-GRPO's
comparison as four arms of one task, each arm one ``marl train`` per seed (bench/learning/seeds.py), one after the
other:

- ``single``: one agent doing the whole task (``--single CONFIG``: the task's one-role environment, as
  configs/demo_solver_alone.yaml is the demo's and configs/chain_solo.yaml the chain's); its team answer where its
  environment chooses one (``arithmetic_chain_solo``: the majority of its n answers), else its greedy headline metric;
- ``shared``: one policy playing every role (``agents.team.roles``: all of CONFIG's roles, with the first agent's
  settings), one engine, one trainer, the same steps;
- ``separate``: a policy per role, CONFIG as it is;
- ``swapped``: the separate arm's last versions with the roles rotated (``marl evaluate``'s ``swapped`` cast).

The team's accuracy is the held-out ``team_answer`` (stages/team.py: the answer the team picks among its n sampled
episodes per case). Per arm: the peak over the evaluated versions and the last version's, each as mean and minimum
over the seeds, and the generated tokens of its training::

    .venv/bin/python -m bench.learning.team configs/chain.yaml --single configs/chain_solo.yaml --seeds 0 1 2 \\
        --set evaluation.cases_per_agent=200 --out /tmp/team.json

The team's episodes have a turn per role, so at the same samples per prompt the single arm generates fewer tokens;
``--single-set pipeline.samples_per_prompt=29 --single-set evaluation.team_samples=16`` gives it the chain team's
tokens (1.8x) at the same optimizer steps, its answer still the majority of 16.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import statistics
import subprocess
from pathlib import Path

import yaml

from bench.learning.seeds import train
from bench.pipeline.bound import config_arguments, override

ROOT = Path(__file__).resolve().parents[2]
SHARED = "team"


def shared_arm(data: dict, roles: list[str]) -> dict:
    """CONFIG with one agent playing every role, with the first agent's settings."""
    shared = copy.deepcopy(data)
    first = next(iter(shared["agents"].values()))
    shared["agents"] = {SHARED: {**first, "roles": roles}}
    shared["run"] = f"{data['run']}_shared"
    return shared


def team_accuracy(history: dict[int, dict[str, dict[str, float]]]) -> dict[int, float]:
    """Version -> the team's held-out accuracy: its ``team_answer``; for a single agent whose environment has no
    ``team_choice`` (``arithmetic_solo``), its greedy headline metric."""
    from marl_pipeline.stages.evaluation import headline_metric

    return {version: m["team"]["team_answer"] if "team" in m else headline_metric(next(iter(m.values())))[1]
            for version, m in history.items()}


def generated_tokens(store: Path, run: str) -> int:
    """The response tokens the run's training sampled."""
    import pyarrow.compute as pc

    from marl_pipeline.store import ExperienceStore

    responses = ExperienceStore(str(store)).read_stage(run, "rollouts", columns=["response_ids"])
    return int(pc.sum(pc.list_value_length(responses.column("response_ids"))).as_py())


def swapped_accuracy(data: dict, seed: int, work: Path, version: int) -> float:
    """The separate arm's policies at ``version`` with the roles rotated, as ``marl evaluate`` plays the cast."""
    from marl_pipeline.run.casts import standard_casts, stored_casts
    from marl_pipeline.store import ExperienceStore

    store = work / f"seed{seed}" / "store"
    players = {agent: agent for agent in data["agents"]}
    swapped = next(cast for cast in standard_casts(players, version) if cast.name == "swapped")
    cast = "swapped:" + ",".join(f"{role}={agent}@{v}" for role, (agent, v) in swapped.roles.items())
    subprocess.run([str(ROOT / ".venv/bin/marl"), "evaluate", str(store), "--run", data["run"], "--version",
                    str(version), "--cast", cast], check=True, cwd=ROOT,
                   env={**os.environ, "DAGSTER_HOME": str(work / f"seed{seed}" / "dagster")})
    return stored_casts(ExperienceStore(str(store)), data["run"])["swapped"]["metrics"]["team_answer"]


def summary(by_seed: dict[int, dict[int, float]]) -> dict[str, float]:
    peaks = [max(curve.values()) for curve in by_seed.values()]
    finals = [curve[max(curve)] for curve in by_seed.values()]
    return {"peak_mean": round(statistics.mean(peaks), 3), "peak_min": round(min(peaks), 3),
            "final_mean": round(statistics.mean(finals), 3), "final_min": round(min(finals), 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", type=Path)
    parser.add_argument("--single", type=Path, required=True, help="the task's one-agent config")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--arms", nargs="+", default=["single", "shared", "separate"],
                        help="arms to train (swapped follows separate)")
    parser.add_argument("--single-set", action="append", default=[], metavar="KEY=VALUE",
                        help="a setting of the single arm alone, after --set (its samples per prompt, for the team's "
                             "generated tokens)")
    args, data = config_arguments(parser, Path("/tmp/marl-bench-team"))
    single = yaml.safe_load(args.single.read_text())
    for setting in args.set:  # the same overrides for the single arm, where they apply to its settings
        if not setting.startswith("agents."):
            override(single, setting)
    for setting in args.single_set:
        override(single, setting)
    from marl_pipeline.environment import get_environment_class, roles_of
    from marl_pipeline.policy.precision import cpu_name

    roles = list(roles_of(get_environment_class(data["environment"]["name"])))
    arms = {"single": single, "shared": shared_arm(data, roles), "separate": data}
    curves: dict[str, dict[int, dict[int, float]]] = {}
    tokens: dict[str, list[int]] = {}
    for arm in args.arms:
        work = args.work / arm
        shutil.rmtree(work, ignore_errors=True)
        for seed in args.seeds:
            history = train(arms[arm], seed, work)
            curves.setdefault(arm, {})[seed] = team_accuracy(history)
            tokens.setdefault(arm, []).append(generated_tokens(work / f"seed{seed}" / "store", arms[arm]["run"]))
            if arm == "separate":
                last = max(history)
                curves.setdefault("swapped", {})[seed] = {last: swapped_accuracy(data, seed, work, last)}
    print(f"{args.config} {args.set} {args.single_set}: {os.cpu_count()} cores, {cpu_name()}, seeds {args.seeds}")
    print("| arm | team accuracy by version, per seed | peak: mean, min | final: mean, min | generated tokens |")
    print("| --- | --- | --- | --- | ---: |")
    results = {}
    for arm, by_seed in curves.items():
        results[arm] = {"by_seed": by_seed, **summary(by_seed), "tokens": tokens.get(arm)}
        shown = "; ".join(f"s{seed}: " + " ".join(f"{value:.3f}" for value in curve.values())
                          for seed, curve in by_seed.items())
        r = results[arm]
        spent = f"{statistics.mean(tokens[arm]):,.0f}" if arm in tokens else "-"
        print(f"| {arm} | {shown} | {r['peak_mean']:.3f}, {r['peak_min']:.3f} | {r['final_mean']:.3f}, "
              f"{r['final_min']:.3f} | {spent} |")
    if args.out:
        args.out.write_text(json.dumps({"config": str(args.config), "single": str(args.single), "set": args.set,
                                        "single_set": args.single_set, "cpu": cpu_name(), "seeds": args.seeds,
                                        "arms": results}, indent=1))


if __name__ == "__main__":
    main()
