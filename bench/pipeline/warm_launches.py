"""Launches in one process with and without ``ray.keep_actors`` (cluster/warm_actors.py), side by side.

Each launch is the test suite's small demo run (tests/conftest.py's ``small_config_data``: two agents on the built-in
tiny model, 2 steps of 2 micro-batches) on a fresh store, so every launch does the same work. Per launch: the seconds
to its first event (set-up: starting policies, actors) and in all. With ``keep_actors`` the first launch starts the
actors and the later ones take them; the weights each launch ends with are checked equal to the first's.

    PYTHONPATH=$PWD .venv/bin/python -m bench.pipeline.warm_launches --launches 3
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def _launch(keep: bool, store: Path) -> tuple[float, float]:
    from marl_pipeline.config import parse_config
    from marl_pipeline.run.recipe import train
    from tests.conftest import small_config_data

    data = small_config_data(yaml.safe_load((ROOT / "configs" / "demo.yaml").read_text()), store, steps=2)
    data["ray"]["keep_actors"] = keep
    started = time.perf_counter()
    first = None
    for _ in train(parse_config(data)):
        first = first or time.perf_counter() - started
    return first, time.perf_counter() - started


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
    args = parser.parse_args()
    import ray

    from marl_pipeline.cluster import warm_actors

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    root = Path(tempfile.mkdtemp(prefix="warm_launches_"))
    print("| keep_actors | launch | set-up s | total s | weights as the first launch's |")
    print("| --- | ---: | ---: | ---: | --- |")
    for keep in (False, True):
        stores = []
        for index in range(args.launches):
            stores.append(root / f"keep={keep}" / str(index))
            setup, total = _launch(keep, stores[-1])
            same = "yes" if _same_weights(stores[0], stores[-1]) else "NO"
            print(f"| {keep} | {index} | {setup:.1f} | {total:.1f} | {same} |", flush=True)
        warm_actors.stop_idle()
    ray.shutdown()


if __name__ == "__main__":
    main()
