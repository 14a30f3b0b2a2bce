"""The one way a benchmark launches a training run: in this process (:func:`launch`, Ray already up) or as a user
does, ``marl train`` in a process of its own with its own Dagster home (:func:`launch_cli`)."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Launch:
    """What every benchmark reads of a launch in this process."""

    setup_seconds: float | None = None
    """To its ``RunStarted``: starting policies and actors (None: it never started)."""
    seconds: float = 0.0
    """In all, to its last event."""
    step_seconds: list[float] = field(default_factory=list)
    """Each ``StepFinished.seconds``, in order."""


def launch(config, on_event: Callable[[object], None] | None = None) -> Launch:
    """Run ``config`` (an ``ExperimentConfig``) in this process through ``marl_pipeline.run.recipe.train``, on the Ray
    this process is connected to; ``on_event`` sees each event as it comes."""
    from marl_pipeline.run.events import RunStarted, StepFinished
    from marl_pipeline.run.recipe import train

    result, started = Launch(), time.perf_counter()
    for event in train(config):
        if isinstance(event, RunStarted) and result.setup_seconds is None:
            result.setup_seconds = time.perf_counter() - started
        elif isinstance(event, StepFinished):
            result.step_seconds.append(event.seconds)
        if on_event is not None:
            on_event(event)
    result.seconds = time.perf_counter() - started
    return result


def launch_cli(data: dict, where: Path) -> float:
    """``marl train`` of ``data`` (written to ``where``/config.yaml, ``where``/dagster its Dagster home) from the
    repository root; its seconds. Fails as the command fails."""
    (where / "dagster").mkdir(parents=True, exist_ok=True)
    config = where / "config.yaml"
    config.write_text(yaml.safe_dump(data))
    return run_cli(config, where / "dagster")


def run_cli(config: Path, home: Path, on_line: Callable[[float, str, int], None] | None = None) -> float:
    """``marl train CONFIG`` with ``home`` as its Dagster home; its seconds. With ``on_line``, its output is read
    here, each line (one a message: no wrapping) given with its seconds from the start and the command's pid."""
    env = {**os.environ, "DAGSTER_HOME": str(home), "COLUMNS": "400" if on_line else "160"}
    started = time.perf_counter()
    command = [str(ROOT / ".venv/bin/marl"), "train", str(config)]
    if on_line is None:
        subprocess.run(command, check=True, cwd=ROOT, env=env)
        return time.perf_counter() - started
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                               cwd=ROOT)
    for line in process.stdout:
        on_line(time.perf_counter() - started, line.strip(), process.pid)
    if process.wait() != 0:
        raise subprocess.CalledProcessError(process.returncode, command)
    return time.perf_counter() - started
