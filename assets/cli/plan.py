"""``marl plan``: the step time of an experiment on a described cluster, simulated with costs from a stored run."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.table import Table

from assets.cli.output import console


def plan(config_path: Path = typer.Argument(..., help="Experiment YAML file.", metavar="CONFIG"),
         calibrate: str = typer.Option(..., "--calibrate", help="Store holding the run to take costs from.",
                                       metavar="STORE"),
         run: list[str] = typer.Option(..., "--run", help="The stored run whose timings give the costs (repeatable: "
                                                          "each figure the mean over the runs)."),
         cluster: str | None = typer.Option(None, help="NODESxCPUS[:GPUS], e.g. 48x96:8 (default: the nodes of the "
                                                       "Ray cluster at the experiment's ray.address or RAY_ADDRESS; "
                                                       "without one, this machine's CPUs)."),
         steps: int | None = typer.Option(None, help="Steps to simulate (default: the experiment's)."),
         gpu: str | None = typer.Option(None, help="GPUs of this kind (h100, h200, a100): engine and trainer costs "
                                                   "from their stated figures and the models' shapes (a roofline), "
                                                   "the workload from the stored run."),
         profile: str | None = typer.Option(None, help="With --gpu: the trainers' MFU from this "
                                                       "marl profile gpu output instead of the roofline's "
                                                       "default."),
         threads_profile: str | None = typer.Option(None, "--threads-profile", help="What a trainer's threads buy "
                                                     "on these CPUs (marl profile threads' file), in "
                                                     "place of a linear speed-up."),
         engine_profiles: list[str] = typer.Option([], "--engine-profile", help="With --gpu: AGENT=FILE, that "
                                                   "agent's engine costs from marl profile engine's output "
                                                   "instead of the roofline (repeatable)."),
         by_length: bool = typer.Option(False, "--by-length", help="With --gpu: each agent's engine tensor "
                                                                  "parallelism and trainer workers by range of "
                                                                  "context length (EARL), from the memory model."),
         search: bool = typer.Option(False, "--search", help="Try allocations (replicas, tensor parallelism, "
                                                             "trainer workers, staleness, micro-batches) and print "
                                                             "the best few with the settings that make each."),
         settings: list[str] = typer.Option([], "--set", help="KEY=VALUE override of the experiment, dotted."),
         output: str = typer.Option("table", "--format", help="table, or json (for scripts).")) -> None:
    """Predict an experiment's step time, each actor's busy share and the staleness of its turns, by simulating
    this orchestrator on its placement plan with costs fitted from a stored run. A projection, not a measurement."""
    from marl_pipeline.cluster.placement import PlacementError
    from marl_pipeline.config import ConfigError, apply_overrides, apply_settings, read_config_data
    from marl_pipeline.planner.capacity import plan_capacity
    from marl_pipeline.store import ExperienceStore, StoreError

    try:
        data = read_config_data(config_path)  # once: the search varies the mapping the config was made from
        config, overrides = apply_settings(data, str(config_path), settings)
        summary = plan_capacity(
            config, apply_overrides(data, overrides), ExperienceStore(calibrate), run,
            cluster=cluster, steps=steps, gpu=gpu, profile=profile, threads_profile=threads_profile,
            engine_profiles=dict(_agent_file(setting) for setting in engine_profiles), by_length=by_length,
            search=search)
    except (ConfigError, PlacementError, StoreError, ValueError) as error:
        console.print(f"[red]{error}[/red]")
        raise typer.Exit(2) from None
    if output == "json":
        print(json.dumps(summary, indent=1))
        return
    console.print(f"[bold]{config.run}[/bold] on {summary['nodes']} (costs from {summary['costs']})")
    for agent, found in summary.get("by_length", {}).items():
        console.print(f"{agent} by context length on {gpu}: " + "; ".join(found["ranges"]))
        console.print(f"  agents.{agent}.parallelism_by_length: {json.dumps(found['parallelism_by_length'])}",
                      style="dim", soft_wrap=True)
    console.print(f"predicted step: [bold]{summary['step_seconds']:.2f} s[/bold] "
                  f"({summary['steps_per_hour']:.0f} steps an hour); bound by {summary['bound']}")
    console.print("the calibration run simulated again: " + "; ".join(
        f"{one['run']} {one['predicted_s']:.2f} s against {one['measured_s']:.2f} s measured ({one['error']:+.1%})"
        for one in summary["calibration_error"]) + " (how far to trust the prediction)")
    table = Table("actor or stage", "busy", title="busy share of the simulated time")
    for name, share in sorted(summary["busy"].items(), key=lambda item: -item[1]):
        table.add_row(name, f"{share:.0%}")
    console.print(table)
    console.print("staleness of the sampled turns: " + ", ".join(
        f"{lag}: {count}" for lag, count in sorted(summary["staleness"].items())))
    if search:
        best = Table("steps an hour", "step", "bound", "marl train --set", title="allocations found, best first")
        for candidate in summary["search"]:
            best.add_row(f"{candidate['steps_per_hour']:.0f}", f"{candidate['step_seconds']:.2f} s",
                         candidate["bound"], " ".join(candidate["settings"]) or "(as written)")
        console.print(best)
    console.print("assumptions: " + "; ".join(summary["assumptions"]), style="dim")
    console.print("a projection by simulation, not a measurement", style="dim")


def _agent_file(setting: str) -> tuple[str, str]:
    agent, equals, path = setting.partition("=")
    if not equals or not agent or not path:
        raise ValueError(f"--engine-profile {setting!r}: expected AGENT=FILE")
    return agent, path
