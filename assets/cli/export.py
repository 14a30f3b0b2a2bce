"""``marl export STORE``: a policy version as a plain Hugging Face directory with its model card and provenance."""

from __future__ import annotations

from pathlib import Path

import typer

from assets.cli.output import console, open_store


def export(store_uri: str = typer.Argument(..., help="Experience store: a directory or s3://bucket/prefix.",
                                           metavar="STORE"),
           run: str = typer.Option(..., help="The run."),
           agent: str | None = typer.Option(None, help="The agent (or --all-agents)."),
           all_agents: bool = typer.Option(False, "--all-agents", help="Every agent of the run, each in OUT/<agent>."),
           out: Path = typer.Option(..., help="New directory to write the model to."),
           version: int | None = typer.Option(None, help="Policy version (default: the newest)."),
           merge: bool = typer.Option(True, help="Merge a LoRA version into a full model (else: its adapters).")
           ) -> None:
    """Write a policy version as a plain Hugging Face directory, loadable by transformers and vLLM, with its model
    card (README.md) and provenance.json: the steps, teammates, evaluation, health and launches that made it."""
    from marl_pipeline.policy.export import require_empty
    from marl_pipeline.run.cards import CARD, PROVENANCE, export_release
    from marl_pipeline.store import StoreError

    if (agent is None) != all_agents:
        console.print("[red]name the agent with --agent, or export every agent with --all-agents (not both)[/red]")
        raise typer.Exit(2)
    store = open_store(store_uri)
    agents = store.checkpoints.agents(run) if all_agents else [agent]
    if not agents:
        console.print(f"[red]no agents in run {run!r} of {store.uri} (runs there: {store.runs() or 'none'})[/red]")
        raise typer.Exit(1)
    chosen = {}
    for name in agents:  # every agent's version checked before anything is written
        versions = store.policy_versions(run, name)
        if not versions:
            console.print(f"[red]no policy versions of agent {name!r} in run {run!r} of {store.uri} (agents there: "
                          f"{store.checkpoints.agents(run) or 'none'})[/red]")
            raise typer.Exit(1)
        chosen[name] = max(versions) if version is None else version
        if chosen[name] not in versions:
            console.print(f"[red]agent {name!r} of run {run!r} has no version {chosen[name]} (versions there, the "
                          f"others pruned or never written: {versions})[/red]")
            raise typer.Exit(1)
    try:
        require_empty(out)
        for name, number in chosen.items():
            target = out / name if all_agents else out
            export_release(store, run, name, number, target, merge=merge)
            console.print(f"{run}/{name} version {number} written to {target}, with {CARD} and {PROVENANCE}")
    except (StoreError, FileExistsError, FileNotFoundError) as error:
        console.print(f"[red]{error}[/red]")
        raise typer.Exit(1) from None

