"""The planner against launches it has not seen (issue 50.4): calibrate from launches of one configuration, write the
predicted step time of other configurations, then run them and compare.

    .venv/bin/python -m bench.planner.planner --work /tmp/planner --steps 20 --cpu

Configurations are the demo's (configs/demo.yaml, evaluation off) varied one setting at a time: streaming and
synchronous, staleness 0 and 1, 1 and 2 engine replicas, swapped trainers, hybrid agents; or, with ``--team trio``, the
same variations of three agents relaying a colour (its own calibration launch); or, with ``--team longtail``, two agents
over three turns (sender, receiver, sender) whose environment replies to every turn after a lognormal delay (median 10
ms, sigma 1: a slow reply now and then holds its episode, and its micro-batch). The calibration configuration is
``streaming`` (engine and trainer apart, 1 replica, staleness 0), launched ``--calibrations`` times first. Step times
are ``StepFinished.seconds`` (since the previous step finished), steps 1.. of each launch (step 0 includes the engines'
first batches), predicted the same way. What a trainer's second thread buys is measured first
(bench/planner/trainer_threads.py, into ``<work>/threads.json``; ``--threads-profile`` to give one, ``--linear-threads``
for none); ``--crowding`` gives the host's crowding exponent (bench/planner/crowding.py fits it from finished runs).

This machine's own speed drifts (a shared host: the calibration configuration, launched again 5-20 minutes after its
calibration, ran 17% faster to 28% slower), so the unseen configurations run in ``--rounds`` rounds, each in the
opposite order to the one before, cut in blocks of ``--recalibrate-every`` launches: before each block the
calibration configuration is launched again, and the block's predictions are fitted from its ``--calibrations``
latest launches and written to ``<work>/predictions.json`` before the block's first launch starts. Each launch is
compared with its own prediction, and each calibration launch that opens a block with the block before's prediction
of it (the calibration configuration's row, not counted in the bar); the report ends with the calibration
configuration's launches in order, how far the host moved. ``--recalibrate-every 0`` calibrates once, before all
the unseen launches (as the design until 2026-11-28 did, whose runs BENCHMARKS.md keeps; it also launched the
calibration configuration in each round). ``--replay`` launches nothing: it predicts a finished
run in ``--work`` again with the checkout's model, each block from the launches it was calibrated from, into
``<work>/replay.json`` (two models on the same launches, after the fact).
Every launch keeps all its versions (their timing.json): about 360 MB a launch of three agents, 8 GB a team's run.
With ``--cpu`` each launch also records each kind of process's CPU seconds a step over steps 1.. (psutil: driver,
engines, trainers, other actors, Ray and the rest), printed and kept in ``results.json``: what the simulation's
charges are checked against.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

from bench.launch import launch

ROOT = Path(__file__).resolve().parents[2]


NODES = [{"CPU": 2.0, "GPU": 0.0}]
"""The cluster every launch runs on and is planned for: this machine's 2 cores as Ray's one node."""


def calibration_runs(runs) -> list[str]:
    """Of a run's launch names, the calibration's: ``streaming`` and its repeats ``streaming.calibration<k>``."""
    return [run for run in runs if run == "streaming" or run.startswith("streaming.calibration")]


def _agents(data: dict, **settings) -> dict:
    """``data`` with ``settings`` merged into every agent (``engine`` and ``trainer`` merged key by key)."""
    data = copy.deepcopy(data)
    for agent in data["agents"].values():
        for key, value in settings.items():
            agent[key] = {**agent.get(key, {}), **value} if isinstance(value, dict) else value
    return data


def variants(base: dict) -> dict[str, dict]:
    """The launches, by name: the base with one setting changed (two for the last ones)."""
    def pipeline(data: dict, **settings) -> dict:
        return {**data, "pipeline": {**data["pipeline"], **settings}}

    return {
        "streaming": base,
        "staleness_1": pipeline(base, staleness=1),
        "synchronous": pipeline(base, mode="synchronous"),
        "replicas_2": _agents(base, engine={"replicas": 2}),
        "swapped": {**base, "ray": {**base.get("ray", {}), "resident_trainers": 1}},
        "hybrid": _agents(base, hybrid=True),
        "synchronous_replicas_2": _agents(pipeline(base, mode="synchronous"), engine={"replicas": 2}),
        "staleness_1_replicas_2": _agents(pipeline(base, staleness=1), engine={"replicas": 2}),
        "hybrid_staleness_1": _agents(pipeline(base, staleness=1), hybrid=True),
        "swapped_synchronous": {**pipeline(base, mode="synchronous"), "ray": {"resident_trainers": 1}},
    }


def base_config(team: str) -> dict:
    """The demo (evaluation off, each agent's engine and trainer apart); three agents relaying a colour
    (``relay_of_three``, registered by the tests' placement module; the demo's pipeline and trainer settings); or the
    long-tail relay (:func:`long_tail_relay`, an observe thread per episode: a reply's seconds are its own)."""
    base = yaml.safe_load((ROOT / "configs" / "demo.yaml").read_text())
    base.pop("evaluation", None)
    for agent in base["agents"].values():
        agent.pop("hybrid", None)
    agent = {"model": "builtin:tiny", "warmup": {"steps": 300, "lr": 0.001}, "trainer": {"lr": 0.001}}
    if team == "trio":
        from tests.test_placement import RelayOfThree

        base |= {"environment": {"name": RelayOfThree.name},
                 "agents": {role: copy.deepcopy(agent) for role in RelayOfThree.turn_order}}
    elif team in ("tool", "gym"):  # plugins written from docs/environments.md alone (examples/), issue 71.6
        from marl_pipeline.environment import register_environment

        if team == "tool":
            from examples.tool_team.tool_team import ToolTeam as plugin
        else:
            from examples.gym_team.gym_team import GymTeam as plugin
        register_environment(plugin)
        base |= {"environment": {"name": plugin.name},
                 "agents": {role: copy.deepcopy(agent) for role in plugin.turn_order}}
    elif team == "longtail":
        env = long_tail_relay()
        base |= {"environment": {"name": env.name}, "agents": {role: copy.deepcopy(agent) for role in env.turn_order}}
        base["pipeline"]["rollout"] = {**base["pipeline"].get("rollout", {}), "observe_threads": 256}
    return base


def long_tail_relay() -> type:
    """``relay_long_tail``, registered: the docs' relay (examples/relay_plugin) over three turns, the sender hearing
    the receiver back, whose ``observe`` sleeps a lognormal delay after every turn."""
    import math
    import random

    from examples.relay_plugin.relay_plugin import RelayGame
    from marl_pipeline.environment import ActionResult, Turn, register_environment

    delays = random.Random(0)

    @register_environment
    class RelayLongTail(RelayGame):
        name = "relay_long_tail"
        turn_order = ("sender", "receiver", "sender")

        def render_prompt(self, role: str, task, transcript: list[Turn]) -> str:
            if not transcript:
                return f"say {task['colour']}:"
            return f"heard {transcript[-1].text.strip()[:20]}:"

        def observe(self, role: str, task, transcript: list[Turn]) -> str:
            time.sleep(delays.lognormvariate(math.log(0.010), 1.0))
            return ""

        def execute(self, task, transcript: list[Turn]) -> list[ActionResult]:
            hit = transcript[2].text.strip() == task["colour"]
            return [ActionResult("sent", True), ActionResult("passed", True),
                    ActionResult("match" if hit else "miss", hit)]

        def score(self, task, transcript: list[Turn], results: list[ActionResult]) -> dict[str, float]:
            return {"sender": float(results[2].success), "receiver": float(results[2].success)}

        def warmup_examples(self, role: str, rng, count: int) -> list[tuple[str, str]]:
            return [(f"say {t['colour']}:" if role == "sender" and i % 2 else f"heard {t['colour']}:", t["colour"])
                    for i, t in enumerate(self.sample_tasks(rng, count))]

    return RelayLongTail


def _process_cpu() -> dict[int, tuple[str, float]]:
    """This process's and every one under it (Ray's, its actors'), by pid: its kind (``driver``, ``engines``,
    ``trainers``, ``hybrid agents``: an engine and trainer in one process, ``other actors``, ``ray and the rest``) and
    its CPU seconds so far (bench/pipeline/startup.py's reader)."""
    from bench.pipeline.startup import cpu_by_pid

    def kind(pid: int, title: str) -> str:
        return ("driver" if pid == os.getpid() else "ray and the rest" if not title.startswith("ray::")
                else "hybrid agents" if "AgentProcess" in title
                else "engines" if "Engine" in title or "StoreAsync" in title
                else "trainers" if "Train" in title else "other actors")

    return {pid: (kind(pid, title), seconds) for pid, (title, seconds) in cpu_by_pid(os.getpid()).items()}


def measured_launch(data: dict, run: str, store_uri: Path, version0_from: str | None,
                    cpu: dict[str, float] | None = None) -> list[float]:
    """Run one launch of ``data`` as ``run``; its steps' ``StepFinished.seconds``. ``cpu``: filled with each kind of
    process's CPU seconds a step (:func:`_process_cpu`) over steps 1.., as the step times are compared."""
    from marl_pipeline.config import parse_config
    from marl_pipeline.run.events import StepFinished
    from marl_pipeline.store import ExperienceStore

    # every version kept: each one's timing.json is what the calibration reads of its step's end
    config = parse_config({**data, "run": run, "store": {"uri": str(store_uri), "retention": {"keep_all": True}}})
    store = ExperienceStore(config.store)
    if version0_from is not None:  # the calibration launch's version 0: no warm-up to repeat
        for agent in config.agents:
            shutil.copytree(store.policy_dir(version0_from, agent, 0), store.policy_dir(run, agent, 0))
    seconds, marks = [], []  # with cpu: the processes' CPU at step 0's end and at the last step's, before teardown

    def seen(event) -> None:
        if isinstance(event, StepFinished):
            seconds.append(event.seconds)
            print(f"  {run} step {event.step}: {event.seconds:.2f} s", flush=True)
            if cpu is not None and len(seconds) in (1, config.pipeline.steps):
                marks.append(_process_cpu())

    launch(config, seen)
    if cpu is not None and len(marks) == 2:
        before, after = marks
        for pid, (kind, used) in after.items():
            if pid in before:
                cpu[kind] = cpu.get(kind, 0.0) + (used - before[pid][1]) / (len(seconds) - 1)
        print(f"  {run} CPU seconds a step: " + ", ".join(f"{kind} {value:.2f}" for kind, value in sorted(cpu.items())),
              flush=True)
    return seconds


def predictions(store_uri: Path, calibrations: list[str], launches: dict[str, dict], order: list[str],
                threads: Path | None, crowding: float | None = None
                ) -> tuple[object, dict[str, list[float]], dict[str, dict[str, float]]]:
    """The costs pooled from the stored ``calibrations`` runs (a trainer's threads' speed-up from the ``threads``
    profile; None: linear; ``crowding``, where given, in place of the profile's), and each launch's predicted step
    times and charge a step by kind of work."""
    from dataclasses import replace

    from marl_pipeline.config import parse_config
    from marl_pipeline.planner.plan import calibration, predict
    from marl_pipeline.planner.threads import ThreadScaling, thread_profile
    from marl_pipeline.store import ExperienceStore

    scaling = thread_profile(threads) if threads else ThreadScaling()
    if crowding is not None:
        scaling = replace(scaling, crowding=crowding)
    costs = calibration(ExperienceStore(str(store_uri)), calibrations, NODES, scaling)
    predicted, charged = {}, {}
    for name in order:
        config = parse_config({**launches[name], "run": name, "store": str(store_uri)})
        prediction = predict(config, NODES, costs)[1]
        predicted[name], charged[name] = prediction.step_seconds, prediction.core_seconds
    return costs, predicted, charged


def report(launched: list[dict], calibrated: list[tuple[str, float]]) -> list[dict]:
    """Print the table and return its rows, one a configuration: each launch's own prediction (``launched``: run,
    configuration, ``predicted`` and ``measured`` mean step seconds, ``charged`` and ``cpu`` by kind of work) against
    its measurement, each configuration's mean of them, the errors over the unseen ones (the bar), and the
    calibration configuration's launches in order (``calibrated``: run, mean step seconds), how far the host moved."""
    rows = []
    for name in dict.fromkeys(one["name"] for one in launched):
        mine = [one for one in launched if one["name"] == name]
        p, m = statistics.mean(one["predicted"] for one in mine), statistics.mean(one["measured"] for one in mine)
        rows.append({"launch": name, "predicted_s": round(p, 3), "measured_s": round(m, 3),
                     "launches": [{"run": one["run"], "predicted_s": round(one["predicted"], 3),
                                   "measured_s": round(one["measured"], 3)} for one in mine],
                     "error": round((p - m) / m, 4), "in_sample": name == "streaming"})
    print("| launch | predicted s/step | measured s/step | error | each launch: predicted, measured |")
    print("| --- | --- | --- | --- | --- |")
    for row in rows:
        each = "; ".join(f"{one['predicted_s']:.2f}, {one['measured_s']:.2f}" for one in row["launches"])
        print(f"| {row['launch']}{' (the next calibration launch)' if row['in_sample'] else ''} | "
              f"{row['predicted_s']:.2f} | {row['measured_s']:.2f} | {row['error']:+.1%} | {each} |")
    if any(one["cpu"] for one in launched):  # the simulation's charge a step beside the processes' CPU
        print("| launch | engines: charged, used | trainers: charged, used | driver: charged, used | hybrid agents: "
              "used (charged as engines and trainers) |")
        print("| --- | --- | --- | --- | --- |")
        for one in launched:
            print(f"| {one['run']} | " + " | ".join(
                f"{one['charged'].get(kind, 0.0):.2f}, {one['cpu'].get(kind, 0.0):.2f}"
                for kind in ("engines", "trainers", "driver"))
                  + f" | {one['cpu'].get('hybrid agents', 0.0):.2f} |")
    unseen = [abs(row["error"]) for row in rows if not row["in_sample"]]
    per_launch = [abs(one["predicted_s"] - one["measured_s"]) / one["measured_s"]
                  for row in rows if not row["in_sample"] for one in row["launches"]]
    if unseen:
        print(f"unseen configurations: {len(unseen)}, median |error| {statistics.median(unseen):.1%}, "
              f"max {max(unseen):.1%}; each launch of them ({len(per_launch)}): median "
              f"{statistics.median(per_launch):.1%}, max {max(per_launch):.1%}, "
              f"{sum(error <= 0.2 for error in per_launch)} within 20%")
    if calibrated:
        first = calibrated[0][1]
        print("the host: the calibration configuration's launches in order, s a step (of the first): "
              + ", ".join(f"{seconds:.3f} ({seconds / first - 1:+.1%})" for _, seconds in calibrated))
    return rows


def measure_threads(out: Path) -> Path:
    """What a trainer's second thread buys on this host now (bench/planner/trainer_threads.py, in a process of its
    own, before Ray starts): the thread profile the predictions use."""
    subprocess.run([sys.executable, "-m", "bench.planner.trainer_threads", "--threads", "1", "2", "--reps", "9",
                    "--out", str(out)], check=True, cwd=ROOT)
    return out


def predicted_in(block: dict) -> list[str]:
    """The configurations a block's predictions cover: its launches' and the calibration configuration's, whose next
    launch opens the following block (main and ``--replay`` predict the same)."""
    return ["streaming", *dict.fromkeys(name for name, _ in block["launches"])]


def compare(plan: list[dict], predicted: list[tuple[dict, dict]], measured: dict[str, list[float]],
            cpu: dict[str, dict[str, float]]) -> list[dict]:
    """Each launch beside its own prediction: ``plan``'s blocks (``predicted``: each one's step times and charges by
    configuration), and each calibration launch that opened a block beside the block before's prediction of it."""
    def one(run: str, name: str, block: int) -> dict:
        steps, charged = predicted[block]
        return {"run": run, "name": name, "predicted": statistics.mean(steps[name][1:]),
                "measured": statistics.mean(measured[run][1:]), "charged": charged[name], "cpu": cpu.get(run, {})}

    launched = []
    for index, block in enumerate(plan):
        if block["opened_by"]:
            launched.append(one(block["opened_by"], "streaming", index - 1))
        launched.extend(one(run, name, index) for name, run in block["launches"])
    return launched


def predicted_again(work: Path, team: str, results: dict, threads: Path | None,
                    crowding: float | None = None) -> list[tuple[dict, dict]]:
    """Each block of the finished run in ``work`` (its ``results``) predicted again with this checkout's model, from
    the calibration launches it was predicted from: its step times and charges by configuration, as main kept them."""
    base = base_config(team)
    base["pipeline"]["steps"] = len(results["measured"]["streaming"])
    return [predictions(work / "store", block["calibrations"], variants(base), predicted_in(block), threads,
                        crowding)[1:] for block in results["plan"]]


def replay(work: Path, team: str, threads: Path | None, crowding: float | None = None) -> None:
    """Predict a finished run of this bench again with this checkout's model, from the calibration launches each of
    its blocks was predicted from, against its measured launches: two models compared on the same launches, after
    the fact. Writes ``<work>/replay.json``; the run's own files are left as they are.

    Raises:
        SystemExit: ``work`` holds no finished run of this design.
    """
    if not (work / "results.json").is_file():
        raise SystemExit(f"--replay {work}: no results.json there (run the bench with --work {work} first)")
    results = json.loads((work / "results.json").read_text())
    if "plan" not in results:
        raise SystemExit(f"--replay {work}: its results.json has no plan of blocks (a run from before the calibration "
                         f"was repeated between blocks, 2026-11-28); run the bench again")
    predicted = predicted_again(work, team, results, threads, crowding)
    measured = results["measured"]
    rows = report(compare(results["plan"], predicted, measured, results.get("cpu_per_step") or {}),
                  [(run, statistics.mean(measured[run][1:])) for run in calibration_runs(measured)])
    (work / "replay.json").write_text(json.dumps({"written": time.time(), "rows": rows,
                                                  "predicted": [steps for steps, _ in predicted]}, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=Path("/tmp/planner"))
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--only", nargs="*", help="Names of the launches to predict and run (default: all).")
    parser.add_argument("--calibrations", type=int, default=2, help="Launches of the calibration's configuration "
                                                                   "whose costs are averaged (marl plan --run, "
                                                                   "repeated).")
    parser.add_argument("--rounds", type=int, default=2, help="Launches of each unseen configuration, each round in "
                                                             "the opposite order to the one before.")
    parser.add_argument("--recalibrate-every", type=int, default=3, help="Launch the calibration configuration "
                        "again after this many unseen launches, and predict the next ones from the --calibrations "
                        "latest of its launches (0: calibrate once, before all the unseen launches).")
    parser.add_argument("--cpu", action="store_true", help="Also measure each kind of process's CPU seconds a step "
                                                           "(psutil) in every launch, into results.json.")
    parser.add_argument("--team", choices=("pair", "trio", "longtail", "tool", "gym"), default="pair",
                        help="pair: the demo's solver and verifier; trio: three agents relaying a colour; longtail: "
                             "two agents over three turns with lognormal environment replies; tool and gym: the "
                             "plugins examples/tool_team and examples/gym_team, written from the docs alone.")
    parser.add_argument("--replay", action="store_true", help="Launch nothing: predict the finished run in --work "
                                                              "(of the same --team) again with this checkout's model.")
    parser.add_argument("--threads-profile", type=Path, help="What a trainer's threads buy "
                                                              "(bench/planner/trainer_threads.py "
                                                              "--out's file; default: measured into "
                                                              "<work>/threads.json before the calibration, and with "
                                                              "--replay the run's own, where it has one).")
    parser.add_argument("--linear-threads", action="store_true", help="No thread profile: T threads T times as "
                                                                      "fast (the model before 2026-11-28).")
    parser.add_argument("--crowding", type=float, help="The host's crowding exponent (planner/shared_cores.py; "
                        "bench/planner/crowding.py fits it from finished runs) in place of the thread profile's "
                        "(none: 0).")
    args = parser.parse_args()
    if args.crowding is not None and not 0 <= args.crowding <= 2:
        parser.error(f"--crowding {args.crowding}: expected a number from 0 to 2 (0: no loss beyond the cores)")
    if args.replay:
        own = args.work / "threads.json"
        return replay(args.work, args.team, None if args.linear_threads else args.threads_profile or (
            own if own.is_file() else None), args.crowding)

    import ray

    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    base = base_config(args.team)
    base["pipeline"]["steps"] = args.steps
    launches = variants(base)
    names = [name for name in launches if name != "streaming" and (not args.only or name in args.only)]
    store_uri = args.work / "store"
    threads = None if args.linear_threads else args.threads_profile or measure_threads(args.work / "threads.json")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    started = time.time()
    cpu: dict[str, dict[str, float]] = {}  # per launch, with --cpu

    def cpu_of(run: str) -> dict[str, float] | None:
        return cpu.setdefault(run, {}) if args.cpu else None

    measured: dict[str, list[float]] = {}
    calibrations: list[str] = []

    def calibrate(run: str) -> None:
        measured[run] = measured_launch(launches["streaming"], run, store_uri,
                                        calibrations[0] if calibrations else None, cpu_of(run))
        calibrations.append(run)

    calibrate("streaming")
    for index in range(2, args.calibrations + 1):
        calibrate(f"streaming.calibration{index}")
    schedule = [(name, f"{name}.round{index + 1}") for index in range(args.rounds)
                for name in (names if index % 2 == 0 else names[::-1])]
    every = args.recalibrate_every or max(len(schedule), 1)
    plan: list[dict] = []
    predicted: list[tuple[dict, dict]] = []
    for start in range(0, len(schedule), every):
        block = {"opened_by": None, "launches": schedule[start:start + every]}
        if start:  # the calibration configuration again, before the block it calibrates
            block["opened_by"] = f"streaming.calibration{len(calibrations) + 1}"
            calibrate(block["opened_by"])
        block["calibrations"] = calibrations[-args.calibrations:]
        costs, steps, charged = predictions(store_uri, block["calibrations"], launches, predicted_in(block),
                                            threads, args.crowding)
        plan.append(block)
        predicted.append((steps, charged))
        written = {"written": time.time(), "threads": costs.threads.describe(), "blocks": [
            {**one, "predicted": steps_of, "core_seconds": charged_of}
            for one, (steps_of, charged_of) in zip(plan, predicted)], "costs": repr(costs)[:2000]}
        (args.work / "predictions.json").write_text(json.dumps(written, indent=1))  # before the block's launches
        print(f"predictions for {[run for _, run in block['launches']]} written, from {block['calibrations']}",
              flush=True)
        for name, run in block["launches"]:
            measured[run] = measured_launch(launches[name], run, store_uri, "streaming", cpu_of(run))
    results = {"measured": measured, "cpu_per_step": cpu, "plan": plan, "wall_s": time.time() - started}
    (args.work / "results.json").write_text(json.dumps(results, indent=1))  # the measurements, before the report
    results["rows"] = report(compare(plan, predicted, measured, cpu),
                             [(run, statistics.mean(measured[run][1:])) for run in calibrations])
    (args.work / "results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
