"""``marl inspect STORE`` summarises a stored run (distributions, failures, health, casts, sample episodes); ``marl
runs STORE`` lists a store's runs."""

from __future__ import annotations

import os

import typer
from rich.table import Table

from assets.cli.evaluate import print_casts
from assets.cli.output import check_format, console, dagster_home, open_store, write_rows
from assets.cli.tables import health_rows, print_evaluation_table, print_health_table, print_reward_table


def inspect(store_uri: str = typer.Argument(..., help="Experience store: a directory or s3://bucket/prefix "
                                             "(endpoint and keys from the AWS_* variables).", metavar="STORE"),
            run: str | None = typer.Option(None, help="Run to summarise (default: every run)."),
            step: int | None = typer.Option(None, help="Only this step."),
            agent: str | None = typer.Option(None, help="Only this agent's turns (samples: episodes it took part in)."),
            sample: int = typer.Option(0, help="Also render N sample episodes as the agents' conversation."),
            wide: bool = typer.Option(False, "--wide", help="Every health signal, for a wide terminal."),
            output: str = typer.Option("table", "--format", help="table, or the health rows of every column as "
                                                                  "json or csv (for scripts).")) -> None:
    """Summarise a stored run: episodes, tokens, reward and staleness distributions, failures, sample episodes."""
    from marl_pipeline.store import ExperienceStore, StoreError

    check_format(output)
    try:
        store = ExperienceStore(store_uri)
        runs = [run] if run else store.runs()
    except StoreError as error:
        console.print(f"[red]{error}[/red]")
        raise typer.Exit(2) from None
    if not runs:
        console.print(f"[yellow]no runs in {store.uri}[/yellow]")
        raise typer.Exit(1)
    try:
        if output != "table":
            write_rows([row for name in runs for row in health_rows(store, name, step, agent)[0]], output)
            return
        for name in runs:
            _print_run(store, name, step, agent, sample, wide)
    except StoreError as error:
        console.print(f"[red]{error}[/red]")
        raise typer.Exit(1) from None



def runs(store_uri: str = typer.Argument(".marl/store", help="Experience store: a directory or s3://bucket/prefix.",
                                         metavar="STORE"),
         output: str = typer.Option("table", "--format", help="table, json or csv (for scripts).")) -> None:
    """The runs in a store: each agent's newest policy version, the launch's target step and state, last activity."""
    from dataclasses import asdict
    from datetime import datetime

    from marl_pipeline.run.launches import run_overview

    check_format(output)
    store = open_store(store_uri)
    _mark_dead_launches(quiet=output != "table")
    names = store.runs()
    if not names:
        console.print(f"[yellow]no runs in {store.uri}[/yellow]")
        raise typer.Exit(1)
    overviews = [run_overview(store, name) for name in names]
    if output != "table":
        write_rows([asdict(run) for run in overviews], output)
        return
    table = Table(title=f"runs in {store.uri}")
    for column in ("run", "newest versions", "target", "state", "last version", "health"):
        table.add_column(column, overflow="fold")  # a long run name folds onto a second line, never cut
    for run in overviews:
        when = "-" if run.last_activity is None else datetime.fromtimestamp(run.last_activity).strftime("%m-%d %H:%M")
        table.add_row(run.run, ", ".join(f"{a} v{v}" for a, v in run.versions.items()) or "-",
                      "-" if run.target_step is None else str(run.target_step), run.state, when,
                      _health_cell(run.health))
    console.print(table)


def _mark_dead_launches(quiet: bool) -> None:
    """Launches of this host whose process died, shown as started in Dagster: marked failed, as the
    `mark_dead_launches` sensor does (for a Dagster home that has runs: DAGSTER_HOME or ./.dagster_home)."""
    home = dagster_home()
    if not (home / "dagster.yaml").is_file():
        return
    import dagster as dg

    from assets.train import fail_dead_launches

    os.environ["DAGSTER_HOME"] = str(home)
    with dg.DagsterInstance.get() as instance:
        failed = fail_dead_launches(instance)
    if failed and not quiet:
        console.print(f"[yellow]marked failed in Dagster, their process gone: {', '.join(failed)}[/yellow]")


def _health_cell(health: dict[str, list[tuple[str, int]]]) -> str:
    """The agents under a collapse warning and since which step ("ok": none)."""
    return "; ".join(f"{agent} {what} since step {since}" for agent, signs in health.items()
                     for what, since in signs) or "ok"



def _print_run(store, run: str, step: int | None, agent: str | None, sample: int, wide: bool = False) -> None:
    from marl_pipeline.store.inspection import inspect_run, sample_episodes, text_histogram

    report = inspect_run(store, run, step, agent)
    scope = "".join(f", {k} {v}" for k, v in (("step", step), ("agent", agent)) if v is not None)
    versions = {a: max(store.policy_versions(run, a), default=None) for a in report["agents"]}
    console.print(f"[bold]run {run}[/bold]{scope}: {report['steps']} steps, {report['episodes']} episodes, "
                  f"{report['turns']} turns, {sum(a['tokens'] for a in report['agents'].values())} response tokens; "
                  f"policy versions {versions}")
    if step is None and agent is None:
        print_reward_table(store, run)
        print_evaluation_table(store, run)
        print_casts(store, run, console)
    print_health_table(store, run, step, agent, wide)
    if step is None:
        _print_verdicts(store, run, report["agents"] if agent is None else [agent])
    _print_services_table(store, run, step)
    table = Table(title="turns, tokens and reward per agent")
    for column in ("agent", "turns", "tokens", "reward mean", "std", "min", "p50", "max"):
        table.add_column(column, justify="left" if column == "agent" else "right")
    for name, figures in report["agents"].items():
        reward = figures["reward"]
        table.add_row(name, str(figures["turns"]), str(figures["tokens"]),
                      *(f"{reward[k]:.3f}" if reward["n"] else "-" for k in ("mean", "std", "min", "p50", "max")))
    console.print(table)
    for name, figures in report["agents"].items():
        if figures["reward"]["n"]:
            console.print(f"reward histogram, {name}:")
            for label, count, bar in text_histogram(figures["reward"]["histogram"]):
                console.print(f"  {label:>16} {count:>6} {bar}")
    staleness = ", ".join(f"{k}: {v} turns" for k, v in report["staleness"].items()) or "no turns"
    console.print(f"policy staleness (step - policy_version): {staleness}")
    if len(report["agents"]) > 1:
        console.print("  per agent: " + "; ".join(f"{name} " + ", ".join(f"{k}: {v}" for k, v in figures.get(
            "staleness", {}).items()) for name, figures in report["agents"].items()))
    if not report["failures"]:
        console.print("failures: none")
    for stage, failure in report["failures"].items():
        console.print(f"[red]failures in {stage}: {failure['rows']} rows[/red]")
        for error, count in list(failure["errors"].items())[:5]:
            console.print(f"  {count} x {error or '(no error message)'}")
    for stage, dropped in report.get("dropped", {}).items():
        console.print(f"over-sampling dropped {dropped['rows']} turns in {stage} (pipeline.rollout.oversample)")
        for reason, count in list(dropped["errors"].items())[:3]:
            console.print(f"  {count} x {reason}")
    for episode in sample_episodes(store, run, sample, step, agent):
        _print_episode(episode)


def _print_verdicts(store, run: str, agents) -> None:
    """One verdict per agent at the run's newest stored step, by the run's own collapse thresholds."""
    from marl_pipeline.run.launches import RECORD, launch_health_settings
    from marl_pipeline.stages.health import health_state

    state = health_state(store, run, launch_health_settings(store.read_record(run, RECORD)))
    for agent in agents:
        signs = state.get(agent, [])
        verdict = "; ".join(f"{what} since step {since}" for what, since in signs) or "no collapse warning"
        console.print(f"verdict, {agent}: " + (f"[yellow]{verdict}[/yellow]" if signs else verdict))


def _print_services_table(store, run: str, step: int | None) -> None:
    """The run's external services over its steps (or one step): calls, 429s, retries, failures, the slowest
    queue wait and call, the quota used."""
    from marl_pipeline.services.figures import service_summary

    rows = service_summary(store, run, step)
    if not rows:
        return
    table = Table(title="external services (429: refused by the service; quota: share of requests_per_second used)")
    for column in ("service", "steps", "calls", "429", "retries", "failed", "wait p99", "call p50", "call p99",
                   "quota"):
        table.add_column(column, justify="left" if column == "service" else "right")
    for row in rows:
        table.add_row(row["service"], str(row["steps"]), str(row["calls"]), str(row["throttled"]),
                      str(row["retries"]), str(row["failures"]), *(_seconds(row[k]) for k in (
                          "queue_wait_p99", "latency_p50", "latency_p99")),
                      "-" if row["request_quota_use"] is None else f"{row['request_quota_use']:.0%}")
    console.print(table)


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}s"


def _print_episode(episode: dict) -> None:
    from rich.markup import escape

    console.rule(f"step {episode['step']}, micro-batch {episode['micro_batch']}, episode {episode['episode']} "
                 f"(task {episode['task_id']})")
    if episode["turns"]:
        console.print(f"[dim]{escape(episode['turns'][0]['prompt_text'] or '')}[/dim]")
    for turn in episode["turns"]:
        reward = "-" if turn["reward"] is None else f"{turn['reward']:.3f}"
        console.print(f"[bold]{escape(turn['agent'])}[/bold] (turn {turn['turn']}, policy v{turn['policy_version']}, "
                      f"reward {reward}, outcome {escape(str(turn['outcome']))}): "
                      f"{escape(turn['response_text'] or '')}")
        if turn.get("reply"):
            console.print(f"  [cyan]environment:[/cyan] {escape(turn['reply'])}")
        if turn["status"] != "ok":
            console.print(f"  [red]{turn['status']}: {escape(str(turn['error']))}[/red]")

