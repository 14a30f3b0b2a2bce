"""The ``marl`` command, one module a command: ``train`` and ``prepare`` (train.py), ``inspect`` and ``runs``
(inspect.py), ``export`` (export.py), ``evaluate`` (evaluate.py), ``plan`` (plan.py), ``profile
threads|engine|crowding`` (profile.py); what they print through in output.py and tables.py. Config loading and
``--set`` are ``marl_pipeline.config``'s. Heavy imports (Dagster, Ray, torch) happen inside the commands, after the
arguments are parsed and the config validated."""

from __future__ import annotations

import typer

from assets.cli.evaluate import evaluate
from assets.cli.export import export
from assets.cli.inspect import inspect, runs
from assets.cli.plan import plan
from assets.cli.profile import profile
from assets.cli.train import prepare, train

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Train teams of LLM agents with RL.")
for command in (train, prepare, inspect, runs, export, plan, evaluate):
    app.command(name=command.__name__)(command)
app.add_typer(profile, name="profile")
