"""Launches in one process with and without ``ray.keep_actors`` (cluster/warm_actors.py), side by side.

Each launch is the test suite's small demo run (tests/conftest.py's ``small_config_data``: two agents on the built-in
tiny model in processes of their own, or with ``--hybrid`` each in one process as configs/demo.yaml has them, or
with ``--workers N`` the solver's trainer on N workers (FSDP2 ranks), 2 steps of 2 micro-batches) on a fresh store,
so every launch does the same work. Per launch: the seconds to its ``RunStarted`` (set-up: starting policies,
actors) and in all. Three ways: new actors each launch; kept actors, the same settings (each engine reloads its
weights); kept actors, the engines' ``max_model_len`` alternating between launches (each engine rebuilt in its
process). The weights each launch ends with are checked equal to the first launch's.

    .venv/bin/python -m bench.pipeline.warm_launches --launches 3 [--hybrid | --workers 2]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import yaml

from bench.launch import Launch, launch

ROOT = Path(__file__).resolve().parents[2]
WAYS = {"new actors": (False, False), "kept, same settings": (True, False), "kept, engines rebuilt": (True, True)}
"""Each way: (``keep_actors``, the engines' settings changed every launch)."""


def _launch(keep: bool, store: Path, max_model_len: int | None, hybrid: bool, workers: int) -> Launch:
    from marl_pipeline.config import parse_config
    from tests.conftest import small_config_data

    demo = yaml.safe_load((ROOT / "configs" / "demo.yaml").read_text())
    for agent in demo["agents"].values():
        agent["hybrid"] = hybrid
    data = small_config_data(demo, store, steps=2)
    data["agents"]["solver"].setdefault("trainer", {})["workers"] = workers
    data["ray"]["keep_actors"] = keep
    if max_model_len is not None:
        for agent in data["agents"].values():
            agent["engine"]["max_model_len"] = max_model_len
    return launch(parse_config(data))


def _same_weights(a: Path, b: Path) -> bool:
    from safetensors.torch import load_file

    for agent in ("solver", "verifier"):
        x, y = (load_file(s / "run=demo" / "policies" / f"agent={agent}" / "version=2" / "model.safetensors")
                for s in (a, b))
        if any(not (x[name] == y[name]).all() for name in x):
            return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launches", type=int, default=3)
    parser.add_argument("--hybrid", action="store_true", help="each agent's engine and trainer in one process")
    parser.add_argument("--workers", type=int, default=1, help="the solver's trainer workers (FSDP2 ranks)")
    args = parser.parse_args()
    import ray

    from marl_pipeline.cluster import warm_actors

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    root = Path(tempfile.mkdtemp(prefix="warm_launches_"))
    print("| way | launch | set-up s | total s | weights as the first launch's |")
    print("| --- | ---: | ---: | ---: | --- |")
    first = None
    for way, (keep, alternate) in WAYS.items():
        for index in range(args.launches):
            store = root / way.replace(" ", "_").replace(",", "") / str(index)
            done = _launch(keep, store, (128 if index % 2 else 256) if alternate else None, args.hybrid,
                           args.workers)
            first = first or store
            same = "yes" if _same_weights(first, store) else "NO"
            print(f"| {way} | {index} | {done.setup_seconds:.1f} | {done.seconds:.1f} | {same} |", flush=True)
        warm_actors.stop_idle()
    ray.shutdown()


if __name__ == "__main__":
    main()
