"""What every ``marl`` command prints through: the console, the formats a table may be written in for scripts, and
opening a store with its error said."""

from __future__ import annotations

import typer
from rich.console import Console

console = Console()

FORMATS = ("table", "json", "csv")


def check_format(output: str) -> None:
    if output not in FORMATS:
        console.print(f"[red]--format {output!r}: expected one of {', '.join(FORMATS)}[/red]")
        raise typer.Exit(2)


def write_rows(rows: list[dict], output: str) -> None:
    """Rows as JSON (a list of objects) or CSV (a header, then a line a row) on standard output, for scripts."""
    import csv
    import json
    import sys

    if output == "json":
        sys.stdout.write(json.dumps(rows, default=str, indent=1) + "\n")
        return
    writer = csv.DictWriter(sys.stdout, fieldnames=list(rows[0]) if rows else [], lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)



def open_store(store_uri: str):
    from marl_pipeline.store import ExperienceStore, StoreError

    try:
        return ExperienceStore(store_uri)
    except StoreError as error:
        console.print(f"[red]{error}[/red]")
        raise typer.Exit(2) from None

