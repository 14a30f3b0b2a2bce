"""Step metrics sent where ML engineers follow training (``tracking`` in the experiment file): TensorBoard event
files, MLflow and Weights & Biases. The Dagster UI stays the primary view; this is a copy of the figures as the
launch makes them.

Per step (the run's global step, so the launches of a run continue one curve), per agent: its mean reward, its
training-health signals (stages/health.py) and its trainer's throughput (``perf/<agent>/tokens_per_s``, real tokens a
second, and ``perf/<agent>/mfu``, a fraction, as verl's ``perf/mfu/actor``); for the team, the mean reward and the
step's time (between step ends) and span (first rollout to commit). Held-out evaluations go in at the evaluated
version's step. Each tracker gets the config without its secrets (``launches.public_config``), as the launch record
does. One MLflow run per run (tagged ``marl.run``), taken up again by its later launches; one wandb run
per run likewise (its id made from the run's name), every metric on the run's step (``step``, wandb's
``define_metric``), so that an evaluation written after its step's metrics lands where it belongs.
"""

from __future__ import annotations

import hashlib
import re
import time
import warnings
from pathlib import Path

from marl_pipeline.config import ExperimentConfig, WandbConfig
from marl_pipeline.run.events import EvaluationCommitted, StepFinished, mean_reward
from marl_pipeline.run.launches import public_config
from marl_pipeline.stages.health import PERF_SIGNALS

RUN_TAG = "marl.run"
STEP = "step"
"""The wandb metric every other is plotted against: the run's global step."""


def signal_metric(agent: str, signal: str) -> str:
    """The tracked name of one of an agent's step signals: its trainer's throughput under ``perf/<agent>/``."""
    return f"perf/{agent}/{signal.removeprefix('trainer_')}" if signal in PERF_SIGNALS else f"{agent}/{signal}"


class MetricsExport:
    """Turns a launch's events into step metrics and writes them to the configured sinks (none: does nothing)."""

    def __init__(self, config: ExperimentConfig) -> None:
        tracking, self.sinks = config.tracking, []
        if tracking.tensorboard is not None:
            self.sinks.append(_TensorBoard(Path(tracking.tensorboard) / config.run))
        if tracking.mlflow is not None:
            self.sinks.append(_MLflow(tracking.mlflow, tracking.mlflow_experiment, config))
        if tracking.wandb is not None:
            self.sinks.append(_Wandb(tracking.wandb, config))

    def add(self, event) -> None:
        if isinstance(event, EvaluationCommitted):
            self._write(event.version, {f"{agent}/eval/{name}": float(value) for agent, metrics in event.metrics.items()
                                        for name, value in metrics.items()})
        elif isinstance(event, StepFinished):
            self._write(event.step, {**{signal_metric(agent, name): value for agent, signals in event.health.items()
                                        for name, value in signals.items() if value is not None},
                                     **{f"{agent}/reward": value for agent, value in event.mean_reward.items()},
                                     "team/mean_reward": mean_reward(event.mean_reward),
                                     "time/step_seconds": event.seconds, "time/span_seconds": event.span_seconds})

    def _write(self, step: int, metrics: dict[str, float]) -> None:
        for sink in list(self.sinks):
            try:
                sink.write(step, metrics)
            except Exception as error:  # a tracking server down must not stop a run: the store has every figure
                warnings.warn(f"metrics to {type(sink).__name__[1:]} stopped: {type(error).__name__}: {error}",
                              stacklevel=2)
                self.sinks.remove(sink)

    def close(self, finished: bool) -> None:
        for sink in self.sinks:
            sink.close(finished)


class _TensorBoard:
    def __init__(self, directory: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(directory))

    def write(self, step: int, metrics: dict[str, float]) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, step)
        self.writer.flush()  # visible to a running `tensorboard` now, and on disk if the process dies

    def close(self, finished: bool) -> None:
        self.writer.close()


class _MLflow:
    def __init__(self, uri: str, experiment: str, config: ExperimentConfig) -> None:
        from mlflow import MlflowClient

        self.client = MlflowClient(uri)
        found = self.client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found else self.client.create_experiment(experiment)
        runs = self.client.search_runs([experiment_id], filter_string=f"tags.`{RUN_TAG}` = '{config.run}'",
                                       max_results=1)
        if runs:  # a later launch of the run: the same MLflow run, its steps continued
            self.run_id = runs[0].info.run_id
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            self.run_id = self.client.create_run(experiment_id, run_name=config.run, tags={RUN_TAG: config.run}
                                                 ).info.run_id
            from mlflow.entities import Param

            params = [Param(name, str(value)[:6000]) for name, value in _flat(public_config(config)).items()]
            for start in range(0, len(params), 100):  # MLflow takes at most 100 parameters a batch
                self.client.log_batch(self.run_id, params=params[start:start + 100])

    def write(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(name, float(value), now, step)
                                                    for name, value in metrics.items()])

    def close(self, finished: bool) -> None:
        self.client.set_terminated(self.run_id, status="FINISHED" if finished else "FAILED")


def wandb_run_id(run: str) -> str:
    """The wandb run id of a run: its name in the characters wandb allows, and a hash of the name itself, so that
    two names alike after that differ."""
    return f"{re.sub(r'[^A-Za-z0-9_-]', '-', run)[:48]}-{hashlib.sha256(run.encode()).hexdigest()[:8]}"


class _Wandb:
    def __init__(self, settings: WandbConfig, config: ExperimentConfig) -> None:
        import wandb

        Path(settings.dir).mkdir(parents=True, exist_ok=True)
        tags = list(dict.fromkeys([config.environment.name, *config.agents, *settings.tags]))
        self.run = wandb.init(
            project=settings.project, name=config.run, id=wandb_run_id(config.run), resume="allow",
            mode=settings.mode, dir=settings.dir, tags=tags, config=public_config(config),
            reinit="create_new",  # its own run beside any other of the process (a notebook's, a second launch's)
            # no console capture, no system-metrics sampler, no banner: the launch's own output stays as it is
            settings=wandb.Settings(console="off", x_disable_stats=True, silent=True))
        self.run.define_metric(STEP)
        self.run.define_metric("*", step_metric=STEP)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log({**metrics, STEP: step})

    def close(self, finished: bool) -> None:
        self.run.finish(exit_code=0 if finished else 1)


def _flat(data: dict, prefix: str = "") -> dict[str, object]:
    """A nested config as MLflow parameters (``agents.solver.trainer.lr``)."""
    flat = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        flat |= _flat(value, f"{name}.") if isinstance(value, dict) and value else {name: value}
    return flat
