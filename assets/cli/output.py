"""What every ``marl`` command prints through, and what it keeps the libraries from printing: the console, Ray's and
the libraries' notices silenced, the formats a table may be written in for scripts, opening a store with its
error said, and the Dagster home the commands share."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import typer
from rich.console import Console

console = Console()

RAY_INIT = {"include_dashboard": False, "log_to_driver": False}
"""The CLI's ``ray.init`` options for the job's Ray resource (its UI is Dagster's; the workers' logs stay theirs)."""

QUIET_ENV = {"TQDM_DISABLE": "1", "TRANSFORMERS_VERBOSITY": "error", "HF_HUB_DISABLE_PROGRESS_BARS": "1",
              "VLLM_LOGGING_LEVEL": "ERROR", "RAY_DEDUP_LOGS": "1", "PYTHONWARNINGS": "ignore"}


class RayStartNotices(logging.Filter):
    """Drops what ``ray.init`` logs that asks nothing of a ``marl`` user: that Ray set no SIGTERM handler (the CLI
    starts Ray on a thread of its own, for start-up time, and handles the signals itself), that Ray enabled token
    authentication by default (it stays enabled; the notice only says how to turn it off) and, the first time on a
    host, that it saved a new token for it, that it started a local instance, and that the job's Ray resource joined
    the one the CLI started (the set-up lines say both)."""

    NOTICES = ("SIGTERM handler is not set", "Token authentication is enabled for this Ray cluster",
               "Generated new authentication token", "Started a local Ray instance", "Calling ray.init() again")
    LOGGERS = ("ray._private.worker", "ray._private.authentication.authentication_token_setup")

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.NOTICES)

    @classmethod
    def install(cls) -> None:
        for name in cls.LOGGERS:
            logger = logging.getLogger(name)
            if not any(isinstance(existing, cls) for existing in logger.filters):
                logger.addFilter(cls())



def quiet_libraries() -> None:
    """What the libraries print that a ``marl`` user did not ask for, turned off before Ray starts (its actors inherit
    the environment): their progress bars and chatter (:data:`QUIET_ENV`) and Ray's start-up notices."""
    import os

    for name, value in QUIET_ENV.items():
        os.environ.setdefault(name, value)
    RayStartNotices.install()

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



def dagster_home() -> Path:
    """The commands' Dagster home: DAGSTER_HOME, else .dagster_home in the working directory (what `dagster dev`
    then shows), as an absolute path."""
    return Path(os.environ.get("DAGSTER_HOME") or Path.cwd() / ".dagster_home").absolute()
