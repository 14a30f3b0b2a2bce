"""``marl evaluate``: the team on held-out cases with stored policy versions cast in its roles (run/casts.py)."""

from __future__ import annotations

import typer
from rich.console import Console
from rich.table import Table

from assets.cli.output import RAY_INIT, console, quiet_libraries

FIGURES = ("team_answer", "first_sample", "majority_vote", "any_sample")


def evaluate(store_uri: str = typer.Argument(..., help="Experience store holding the run.", metavar="STORE"),
             run: str = typer.Option(..., help="The stored run whose policies are cast."),
             version: int | None = typer.Option(None, help="The version the standard casts use (default: the "
                                                           "newest every agent has)."),
             cast: list[str] = typer.Option([], "--cast", metavar="[NAME:]ROLE=AGENT@VERSION,...",
                                            help="A cast of your own: every role a stored policy, e.g. "
                                                 "mixed:solver=solver@100,verifier=verifier@0 (repeatable). "
                                                 "Without one: trained, swapped and each agent's version 0 beside "
                                                 "its teammates'.")) -> None:
    """Evaluate the team with any stored policy in any role: trained, swapped, one agent at version 0."""
    import ray

    from marl_pipeline.config import ConfigError, parse_config
    from marl_pipeline.environment import build_environment
    from marl_pipeline.run.casts import chosen_casts, evaluate_cast
    from marl_pipeline.run.launches import launch_history
    from marl_pipeline.store import ExperienceStore, StoreError

    try:
        store = ExperienceStore(store_uri)
        launches, configs = launch_history(store, run)
        if not launches:
            raise StoreError(f"run {run!r} of {store.uri} has no recorded launch to take its config from")
        config = parse_config({**configs[launches[-1]["config"]], "store": store_uri},
                              source=f"run {run!r}'s last launch")
        agents = list(config.agents)
        newest = min(max(store.policy_versions(run, agent), default=0) for agent in agents)
        casts = chosen_casts(cast, config.role_agents(), newest if version is None else version)
    except (StoreError, ConfigError, ValueError) as error:
        console.print(f"[red]{error}[/red]")
        raise typer.Exit(2) from None
    env = build_environment(config.environment.name, config.environment.options)
    started = not ray.is_initialized()  # a caller's Ray (a notebook, a test) is joined and left running
    if started:
        quiet_libraries()
        ray.init(address=config.ray.address, **RAY_INIT)
    table = _casts_table(f"run {run}: the team by cast, on {config.evaluation.cases_per_agent} held-out cases")
    try:
        for one in casts:
            entry = evaluate_cast(config, env, store, one)
            table.add_row(one.name, one.describe(), *(f"{entry['metrics'][name]:.3f}" for name in FIGURES))
    except (StoreError, ValueError) as error:
        console.print(f"[red]{error}[/red]")
        raise typer.Exit(2) from None
    finally:
        if started:
            ray.shutdown()
    console.print(table)
    console.print("first_sample and majority_vote: the answering role alone on the same episodes (the single-agent "
                  "baseline); any_sample: a right answer among them. Kept in the run's casts.json.")


def print_casts(store, run: str, out: Console) -> None:
    """``marl inspect``'s table of the run's evaluated casts (nothing when none)."""
    from marl_pipeline.run.casts import stored_casts

    casts = stored_casts(store, run)
    if not casts:
        return
    table = _casts_table("the team by cast (marl evaluate)")
    for name, entry in casts.items():
        roles = ", ".join(f"{role}={cast['agent']}@{cast['version']}" for role, cast in entry["roles"].items())
        table.add_row(name, roles, *(f"{entry['metrics'][figure]:.3f}" for figure in FIGURES))
    out.print(table)


def _casts_table(title: str) -> Table:
    table = Table(title=title)
    for column in ("cast", "roles", *FIGURES):
        table.add_column(column, justify="left" if column in ("cast", "roles") else "right")
    return table
