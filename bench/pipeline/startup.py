"""Benchmark: start-up, from the ``marl train`` command to its first rollout (issue 28.3), against the bare libraries
starting the same engines and models in one process.

1. **pipeline**: ``marl train`` (the CLI, as a user runs it) on CONFIG with ``--set`` overrides, twice on a fresh
   store and Dagster home. The first launch makes each agent's version 0 (a warm-up trains it); the second resumes
   from the store, and its start-up is the one measured. Each line the CLI prints is timed from the command's start:
   the set-up phases (Ray, the plan, each engine and trainer as it comes up) and the first step. The first rollout
   starts as the last set-up line ("engines ... started") prints; the CLI polls the run's log every 0.5 s.
2. **bare**: one Python process that does the same preparation with the bare libraries, nothing else: imports vLLM
   and transformers, builds one ``vllm.LLM`` per agent with the launch's engine settings (and the engine's
   environment), loads each agent's model for training with transformers, and samples one request per engine.

    .venv/bin/python -m bench.pipeline.startup configs/demo.yaml
    .venv/bin/python -m bench.pipeline.startup configs/demo.yaml --set 'agents.*.model=smollm2-135m-instruct' \
        --set 'agents.*.warmup.steps=0' --set 'agents.*.engine.kv_cache_gib=0.5' --set algorithm.max_new_tokens=48
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

from bench.launch import run_cli
from bench.pipeline.bound import config_arguments, read_stat

ROOT = Path(__file__).resolve().parents[2]
LINE = re.compile(r"^(set-up: .*|step \d+: .*)$")


def _title(argv: list[str]) -> str:
    """``ray::<class>`` for an actor's process, the script for a Python one, else the executable."""
    if argv[0].startswith("ray::"):
        return argv[0].split(".")[0].split()[0]
    if Path(argv[0]).name.startswith("python"):
        argv = [arg for arg in argv[1:] if arg and not arg.startswith("-")] or argv
    return Path(argv[0]).name or "?"


def cpu_by_pid(root: int) -> dict[int, tuple[str, float]]:
    """``root`` and every process under it, by pid: its title (Ray names an actor's process ``ray::<class>``; the rest
    by executable) and its CPU seconds (user + system) so far."""
    parents, seconds, titles = {}, {}, {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            argv = (stat.parent / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:  # it ended meanwhile
            continue
        if (read := read_stat(stat)) is not None:
            pid = int(stat.parent.name)
            _, parents[pid], seconds[pid] = read
            titles[pid] = _title(argv)
    under = {}
    for pid in seconds:
        ancestor = pid
        while ancestor not in (root, 0, 1) and ancestor in parents:
            ancestor = parents[ancestor]
        if ancestor == root:
            under[pid] = (titles[pid], seconds[pid])
    return under


def cpu_by_process(root: int) -> dict[str, float]:
    """CPU seconds so far of ``root`` and every process under it, summed by process title (:func:`cpu_by_pid`): where
    start-up's CPU went."""
    totals: dict[str, float] = {}
    for title, seconds in cpu_by_pid(root).values():
        totals[title] = round(totals.get(title, 0.0) + seconds, 2)
    return dict(sorted(totals.items(), key=lambda item: -item[1]))


def marl_train(config: Path, home: Path, cpu: dict | None = None) -> list[tuple[float, str]]:
    """``marl train CONFIG``'s set-up and step lines, each with its seconds from the command's start; ``cpu`` gets
    :func:`cpu_by_process` as the first rollout starts."""
    lines = []

    def seen(seconds: float, line: str, pid: int) -> None:
        if LINE.match(line):
            lines.append((round(seconds, 2), line))
            print(f"  {lines[-1][0]:6.2f} s  {lines[-1][1]}", flush=True)
            if cpu is not None and not cpu and line.startswith("set-up: engines"):
                cpu.update(cpu_by_process(pid))
                print(f"  CPU seconds by process at the first rollout: {cpu}", flush=True)

    run_cli(config, home, seen)
    return lines


BARE = """
import os, sys, time, json
started = time.perf_counter()
settings = json.loads(sys.argv[1])
os.environ.update(settings["env"])
import vllm, transformers
imported = time.perf_counter()
engines = [vllm.LLM(model=agent["model_dir"], **settings["engine"], **agent["engine"]) for agent in settings["agents"]]
built = time.perf_counter()
models = [transformers.AutoModelForCausalLM.from_pretrained(agent["model_dir"]) for agent in settings["agents"]]
loaded = time.perf_counter()
for engine in engines:
    engine.generate(["warm-up"], vllm.SamplingParams(max_tokens=2, seed=0, logprobs=0), use_tqdm=False)
print(json.dumps({"imports_s": imported - started, "engines_s": built - imported, "models_s": loaded - built,
                  "first_generation_s": time.perf_counter() - loaded, "done_at": time.time()}))
"""


def bare(config_path: Path) -> dict:
    """The bare libraries' start-up for the same agents, in one process with all cores."""
    from marl_pipeline.config import load_config
    from marl_pipeline.inference.engine import ENGINE_ENV, MAX_NUM_SEQS, engine_dtype, kv_cache_bytes
    from marl_pipeline.store import ExperienceStore

    config = load_config(config_path)
    store = ExperienceStore(config.store)
    agents = []
    for name, agent in config.agents.items():
        model_dir = str(store.policy_dir(config.run, name, 0))
        engine = agent.engine
        agents.append({"model_dir": model_dir, "engine": {
            "dtype": engine_dtype(engine.dtype), "max_model_len": engine.max_model_len, "seed": config.seed,
            "kv_cache_memory_bytes": kv_cache_bytes(model_dir, max_model_len=engine.max_model_len, dtype=engine.dtype,
                                                    gpu_memory_utilization=engine.gpu_memory_utilization,
                                                    kv_cache_gib=engine.kv_cache_gib)}})
    settings = {"env": ENGINE_ENV, "agents": agents,
                "engine": {"enforce_eager": True, "max_num_seqs": MAX_NUM_SEQS}}
    started = time.time()  # wall clock, shared with the child: its exit (engines freed) is not start-up
    out = subprocess.run([sys.executable, "-c", BARE, json.dumps(settings)], capture_output=True, text=True,
                         check=True).stdout
    result = json.loads(out.strip().splitlines()[-1])
    result["process_s"] = result.pop("done_at") - started
    return {key: round(value, 2) for key, value in result.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", type=Path)
    parser.add_argument("--steps", type=int, default=1, help="steps per launch")
    args, data = config_arguments(parser, Path("/tmp/marl-bench-startup"))
    shutil.rmtree(args.work, ignore_errors=True)
    (args.work / "dagster").mkdir(parents=True)
    data.update(run="startup", store=str(args.work / "store"))
    data["pipeline"]["steps"] = args.steps
    data.pop("evaluation", None)
    config = args.work / "config.yaml"
    config.write_text(yaml.safe_dump(data))
    from marl_pipeline.policy.precision import cpu_has_bf16, cpu_name

    cpu = cpu_name()
    print(f"{args.config} {args.set}: {os.cpu_count()} cores, {cpu}{', native bf16' if cpu_has_bf16() else ''}")
    print("first launch (makes version 0):", flush=True)
    first = marl_train(config, args.work / "dagster")
    print("second launch (resumes from the store):", flush=True)
    cpu: dict[str, float] = {}
    second = marl_train(config, args.work / "dagster", cpu)
    to_rollout = next(seconds for seconds, line in second if line.startswith("set-up: engines"))
    print("bare libraries, one process:", flush=True)
    floor = bare(config)
    print(f"  {floor}", flush=True)
    result = {"config": str(args.config), "set": args.set, "cpu": cpu, "first_launch": first, "second_launch": second,
              "to_first_rollout_s": to_rollout,
              "cpu_at_first_rollout": cpu, "bare": floor, "ratio": round(to_rollout / floor["process_s"], 2)}
    print(f"command to first rollout: {to_rollout:.1f} s; bare libraries: {floor['process_s']:.1f} s; "
          f"ratio {result['ratio']}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
