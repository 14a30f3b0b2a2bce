"""The ``marl`` command: ``train CONFIG`` runs the Dagster train job; ``inspect STORE`` summarises a stored run;
``runs STORE`` lists a store's runs; ``export STORE`` writes a policy version as a plain Hugging Face model with its
model card and provenance.

Heavy imports (Dagster, Ray, torch) happen after the arguments are parsed and the config validated.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from pathlib import Path

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from assets.evaluate_cli import evaluate, print_casts
from assets.plan_cli import plan
from marl_pipeline.config import ConfigError, apply_settings, read_config_data

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Train teams of LLM agents with RL.")
console = Console()
app.command(name="plan")(plan)
app.command(name="evaluate")(evaluate)


_RAY_INIT = {"include_dashboard": False, "log_to_driver": False}
"""The CLI's ``ray.init`` options for the job's Ray resource (its UI is Dagster's; the workers' logs stay theirs)."""

_QUIET_ENV = {"TQDM_DISABLE": "1", "TRANSFORMERS_VERBOSITY": "error", "HF_HUB_DISABLE_PROGRESS_BARS": "1",
              "VLLM_LOGGING_LEVEL": "ERROR", "RAY_DEDUP_LOGS": "1", "PYTHONWARNINGS": "ignore"}


class _RayStartNotices(logging.Filter):
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


def _dagster_home() -> Path:
    """DAGSTER_HOME, defaulting to .dagster_home in the working directory (what `dagster dev` then shows)."""
    home = Path(os.environ.get("DAGSTER_HOME") or Path.cwd() / ".dagster_home").absolute()
    home.mkdir(parents=True, exist_ok=True)
    settings = home / "dagster.yaml"
    if not settings.exists():
        settings.write_text("telemetry:\n  enabled: false\n")
    os.environ["DAGSTER_HOME"] = str(home)
    return home


def train_run_config(config_path: Path, settings: list[str]):
    """The experiment CONFIG with ``--set`` KEY=VALUE settings, validated, and the train job's ``experiment``
    resource config that gives a run the same: the file and the settings as the launchpad's ``overrides``."""
    config, overrides = apply_settings(read_config_data(config_path), str(config_path), settings)
    return config, {"config_path": str(config_path), **({"overrides": overrides} if overrides else {})}


@app.command()
def train(config_path: Path = typer.Argument(..., help="Experiment YAML file.", metavar="CONFIG"),
          settings: list[str] = typer.Option([], "--set", metavar="KEY=VALUE",
                                             help="Override a setting, as the launchpad's overrides do: "
                                                  "pipeline.steps=5, seed=1, agents.*.trainer.lr=1e-5 (every agent); "
                                                  "the value is read as YAML. Repeatable.")) -> None:
    """Run the Dagster `train` job on CONFIG, with a progress bar and a reward-per-step table."""
    try:
        config, experiment = train_run_config(config_path, settings)
    except ConfigError as error:
        console.print(f"[red]{error}[/red]")
        raise typer.Exit(2) from None
    home = _dagster_home()
    # The progress bar and the reward table are the CLI's output: quiet the libraries' own bars and chatter
    # (set before Ray starts, so the engine and trainer actors inherit them). Errors still propagate.
    for name, value in _QUIET_ENV.items():
        os.environ.setdefault(name, value)
    _RayStartNotices.install()
    local_ray = _LocalRay(config) if config.ray.address is None else None
    from marl_pipeline.cluster.heap import collector_paused

    with collector_paused():  # what the imports make lives as long as the command (cluster/heap.py)
        import dagster as dg

        from assets.definitions import defs
        from assets.train import RUN_TAG

        instance = dg.DagsterInstance.get()
    run_id = str(uuid.uuid4())  # what Dagster's own run ids are; the CLI needs it before the run starts
    # The Definitions' store and Ray resources nest `experiment`, so this one path configures all three; Ray's
    # address and local CPU count come from the YAML's `ray:` through the resource, as in `dagster dev`.
    run_config = {"resources": {
        "experiment": {"config": experiment},
        "ray": {"config": {"ray_init_options": _RAY_INIT}},
    }, "loggers": {"console": {"config": {"log_level": "WARNING"}}}}  # the event log keeps everything
    outcome: dict = {}

    def execute() -> None:
        try:
            outcome["result"] = defs.get_job_def("train").execute_in_process(
                run_config=run_config, instance=instance, run_id=run_id, raise_on_error=False,
                tags={RUN_TAG: config.run})  # from the start: a launch killed before its op began is found too
        except BaseException as error:
            outcome["error"] = error

    started = time.perf_counter()
    if local_ray is not None:
        local_ray.ready.wait()  # the Ray resource joins it (resources/ray_cluster.py)
    worker = threading.Thread(target=execute, name="marl-train-job")
    worker.start()
    _follow(instance, run_id, config.run, worker)
    worker.join()
    if local_ray is not None:
        local_ray.release()  # the resource has shut Ray down
    if "error" in outcome:
        raise outcome["error"]
    result = outcome["result"]
    if not result.success:
        console.print(f"[red]train job failed[/red] (run {run_id}); see `dagster dev -w workspace.yaml`")
        for event in result.all_events:
            if event.is_step_failure and event.step_failure_data:
                failure, told = event.step_failure_data, event.step_failure_data.user_failure_data
                # a dg.Failure the op raised says what happened (health.on_collapse: stop); an error shows its trace
                console.print(told.description if told is not None and told.description else
                              failure.error.to_string() if failure.error else "")
        raise typer.Exit(1)
    from marl_pipeline.store import ExperienceStore

    store = ExperienceStore(config.store)
    _print_reward_table(store, config.run)
    _print_evaluation_table(store, config.run)
    console.print(f"run {run_id} finished in {time.perf_counter() - started:.0f} s; DAGSTER_HOME={home}")


@app.command()
def prepare(config_path: Path = typer.Argument(..., help="Experiment YAML file.", metavar="CONFIG"),
            settings: list[str] = typer.Option([], "--set", metavar="KEY=VALUE",
                                               help="Override a setting, as `marl train --set` does.")) -> None:
    """Make version 0 of every agent that lacks it in the store (the built-in model, the supervised warm-ups), as
    the `base_policies` asset does: what `make train` runs before its first launch, so that launch starts from it."""
    from marl_pipeline.store import ExperienceStore

    try:
        config, _ = train_run_config(config_path, settings)
    except ConfigError as error:
        console.print(f"[red]{error}[/red]")
        raise typer.Exit(2) from None
    store = ExperienceStore(config.store)
    missing = [agent for agent in config.agents if not store.policy_versions(config.run, agent)]
    if not missing:
        console.print(f"run {config.run}: every agent has its version 0 in {store.uri}")
        return
    for name, value in _QUIET_ENV.items():
        os.environ.setdefault(name, value)
    _RayStartNotices.install()
    started = time.perf_counter()
    with console.status(f"run {config.run}: making version 0 of {', '.join(missing)} (built-in model, warm-ups)"):
        import ray

        from marl_pipeline.bootstrap.policies import prepare_base_policies
        from marl_pipeline.environment import build_environment

        if not ray.is_initialized():
            ray.init(**(config.ray.local_init_options(_RAY_INIT) if config.ray.address is None
                        else {"address": config.ray.address, **_RAY_INIT}))
        try:
            made = prepare_base_policies(config, build_environment(config.environment.name,
                                                                   config.environment.options), store, on_ray=True)
        finally:
            ray.shutdown()
    for policy in made:
        if policy.created:
            loss = ("" if policy.warmup_loss is None
                    else f", warm-up loss {policy.warmup_loss[0]:.3f} -> {policy.warmup_loss[1]:.3f}")
            console.print(f"version 0 of {policy.agent} made{loss}")
    console.print(f"run {config.run}: version 0 of every agent in {store.uri} ({time.perf_counter() - started:.0f} s)")


class _LocalRay:
    """The embedded local Ray the job's Ray resource would start (``resolved``: the YAML's ``ray.num_cpus``), started
    at once on a thread of its own: its processes come up while this one imports Dagster and the assets, about 2 s
    of a launch's start-up. The resource finds it running and joins it. A failed start is left to the resource,
    which reports it."""

    def __init__(self, config) -> None:
        self.options = config.ray.local_init_options(_RAY_INIT)
        self.ready, self._done = threading.Event(), threading.Event()
        threading.Thread(target=self._run, name="marl-ray-start", daemon=True).start()

    def _run(self) -> None:
        import ray

        try:
            ray.init(**self.options)
        except Exception:  # the resource starts it, or says why not
            pass
        finally:
            self.ready.set()
        # Ray's processes are killed when the thread that started them ends (PR_SET_PDEATHSIG): it waits for the job
        self._done.wait()

    def release(self) -> None:
        """Stop Ray where the job's Ray resource has not (a run that failed before its resources started), so that no
        thread of this process waits on a GCS gone with the thread that started it, then end that thread."""
        import ray

        if ray.is_initialized():
            ray.shutdown()
        self._done.set()


class _PolicyProgress:
    """A train-job run's policy versions: those its launch will commit (``total``) and those committed (``done``).

    Read from the run's event log by cursor, so each poll fetches only the records logged since the last one.
    The total is the op's own launch plan (``assets.train.plan_observations``, one ``policies`` observation per
    agent), so a resumed launch counts only the versions it has left; None until the op has planned.
    """

    def __init__(self, instance, run_id: str) -> None:
        self.instance, self.run_id = instance, run_id
        self.total: int | None = None
        self.done = 0
        self.lines: list[str] = []
        """The launch's set-up phases, what it does (new, continued, resumed at step N) and its finished steps
        logged since the last poll (``assets.train.SETUP_PREFIX``, ``LAUNCH_PREFIX`` and ``STEP_PREFIX`` lines)."""
        self._cursor: str | None = None
        self._spans: dict[str, tuple[int, int]] = {}  # per agent's partition: (from, to) versions

    def poll(self) -> int:
        """Read the records logged since the last poll; returns how many there were."""
        import dagster as dg

        from assets.train import LAUNCH_PREFIX, SETUP_PREFIX, STEP_PREFIX

        connection = self.instance.get_records_for_run(self.run_id, cursor=self._cursor)
        self.lines = []
        for record in connection.records:
            entry = record.event_log_entry
            event = entry.dagster_event
            if event is None:
                if entry.user_message.startswith((SETUP_PREFIX, LAUNCH_PREFIX, STEP_PREFIX)):
                    self.lines.append(entry.user_message)
                continue
            if not (event.is_asset_observation or event.is_step_materialization) or (
                    event.asset_key != dg.AssetKey("policies")):
                continue
            if event.is_asset_observation:
                metadata = event.asset_observation_data.asset_observation.metadata
                # A later launch of the same job (a new layout, run/layouts.py) resumes where the first stopped:
                # each agent's versions run from its first launch's start to the last launch's end.
                start, _ = self._spans.get(event.partition, (metadata["launch_from_version"].value, None))
                self._spans[event.partition] = (start, metadata["launch_to_version"].value)
                self.total = sum(end - begin for begin, end in self._spans.values())
            else:
                self.done += 1
        self._cursor = connection.cursor
        return len(connection.records)


def _follow(instance, run_id: str, run: str, worker: threading.Thread) -> None:
    """Progress bar over the job's policy versions, read from the Dagster event log while the job runs."""
    followed = _PolicyProgress(instance, run_id)
    with Progress(TextColumn("[bold]training[/bold] {task.description}"), BarColumn(),
                  TextColumn("{task.fields[versions]}"), TimeElapsedColumn(), console=console) as progress:
        task = progress.add_task(run, total=None, versions="setting up")
        while True:
            finished = not worker.is_alive()  # checked before the last poll, so that poll sees every event
            followed.poll()
            for line in followed.lines:
                progress.console.print(line)
            if followed.total is not None:
                progress.update(task, total=followed.total, completed=followed.done,
                                versions=f"{followed.done}/{followed.total} policy versions")
            if finished:
                break
            time.sleep(0.5)


def _print_reward_table(store, run: str) -> None:
    from marl_pipeline.store.summaries import reward_table

    rewards = store.read_stage(run, "rewards", columns=["step", "agent", "reward"])
    by_step = reward_table(rewards)
    agents = sorted({agent for row in by_step.values() for agent in row})
    table = Table(title=f"mean reward per step, run {run}")
    table.add_column("step", justify="right")
    for agent in agents:
        table.add_column(agent, justify="right")
    table.add_column("mean", justify="right", style="bold")
    for step, row in by_step.items():
        values = [row.get(agent, float("nan")) for agent in agents]
        table.add_row(str(step), *(f"{v:.3f}" for v in values), f"{sum(values) / len(values):.3f}")
    console.print(table)


HEALTH_STEPS_SHOWN = 10
HEALTH_HEADERS = {"zero_variance_groups": "zero-var groups", "distinct_responses": "distinct",
                  "top_response_share": "top share", "top_answer_share": "top overall", "token_entropy": "entropy",
                  "response_length": "length", "truncated_share": "cut", "loss_per_token": "loss/token",
                  "clip_fraction": "clipped", "mismatch_abs_logprob": "mismatch", "grad_norm": "grad norm",
                  "short_groups": "short groups", "shortfall": "shortfall", "dropped_episodes": "dropped",
                  "reward_mean": "reward", "top_answer_reward": "top earns", "reward_max": "best reward",
                  "staleness_max": "max lag", "stale_share": "stale"}
HEALTH_NARROW = {"top_answer_share": "top", "zero_variance_groups": "zero-var", "token_entropy": "entropy",
                 "response_length": "length", "clip_fraction": "clip", "grad_norm": "grad norm"}
"""The signals an 80-column terminal shows (the collapse rules' two first): ``--wide`` shows every one, ``--format
json`` or ``csv`` gives the whole table to scripts."""

FORMATS = ("table", "json", "csv")


def _check_format(output: str) -> None:
    if output not in FORMATS:
        console.print(f"[red]--format {output!r}: expected one of {', '.join(FORMATS)}[/red]")
        raise typer.Exit(2)


def _write_rows(rows: list[dict], output: str) -> None:
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


def _health_rows(store, run: str, step: int | None, agent: str | None) -> tuple[list[dict], int]:
    """The ``health`` rows of the newest steps (or ``step``), each with its run and step, and how many steps."""
    from marl_pipeline.store import MicroBatchKey

    steps = sorted({key.step for key in store.committed_keys(run, "health")})
    steps = [s for s in steps if s == step] if step is not None else steps[-HEALTH_STEPS_SHOWN:]
    rows = [{"run": run, "step": s, **row} for s in steps
            for row in store.read("health", MicroBatchKey(run, s, 0)).to_pylist()
            if agent is None or row["agent"] == agent]
    return rows, len(steps)


def _print_health_table(store, run: str, step: int | None, agent: str | None, wide: bool = False) -> None:
    """Each agent's training-health signals per step (the ``health`` dataset): the newest steps, or ``step``; the
    signals that matter (:data:`HEALTH_NARROW`), or with ``wide`` every one but the trainer's throughput."""
    from marl_pipeline.stages.health import HEALTH_SIGNALS, PERF_SIGNALS, groups_note

    rows, steps = _health_rows(store, run, step, agent)
    if not rows:
        return
    headers = ({name: HEALTH_HEADERS[name] for name in HEALTH_SIGNALS if name not in PERF_SIGNALS} if wide
               else HEALTH_NARROW)
    table = Table(title=f"training health per step, run {run}" + (f", the last {steps}" if step is None else "")
                  + ("" if wide else " (--wide: every signal)"))
    table.add_column("step", justify="right")
    table.add_column("agent")
    for header in headers.values():
        table.add_column(header, justify="right")
    for row in rows:
        table.add_row(str(row["step"]), row["agent"],
                      *("-" if row[name] is None else f"{row[name]:.3g}" for name in headers))
    console.print(table)
    if not wide:  # the groups' figures, under the table, where a step has any (--wide: in it)
        for step in sorted({row["step"] for row in rows}):
            if note := groups_note({row["agent"]: row for row in rows if row["step"] == step}):
                console.print(f"step {step}: {note[2:]}")


def _print_evaluation_table(store, run: str) -> None:
    """Each agent's held-out headline metric and top-answer share per evaluated version (if any were)."""
    from marl_pipeline.run.evaluations import evaluation_history
    from marl_pipeline.stages.evaluation import headline_metric

    history = evaluation_history(store, run)
    if not history:
        return
    agents = sorted({agent for by_agent in history.values() for agent in by_agent})
    table = Table(title=f"held-out evaluation per policy version, run {run} (greedy; top = share of the most "
                        f"frequent answer)")
    table.add_column("version", justify="right")
    for agent in agents:
        name = headline_metric(next(m[agent] for m in history.values() if agent in m))[0]
        table.add_column(f"{agent} {name}", justify="right")
        table.add_column(f"{agent} top", justify="right")
    for version, by_agent in history.items():
        cells = []
        for agent in agents:
            if (metrics := by_agent.get(agent)) is None:
                cells += ["-", "-"]
            else:
                cells += [f"{headline_metric(metrics)[1]:.3f}", f"{metrics['top_answer_share']:.2f}"]
        table.add_row(str(version), *cells)
    console.print(table)


@app.command()
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

    _check_format(output)
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
            _write_rows([row for name in runs for row in _health_rows(store, name, step, agent)[0]], output)
            return
        for name in runs:
            _print_run(store, name, step, agent, sample, wide)
    except StoreError as error:
        console.print(f"[red]{error}[/red]")
        raise typer.Exit(1) from None


def _open_store(store_uri: str):
    from marl_pipeline.store import ExperienceStore, StoreError

    try:
        return ExperienceStore(store_uri)
    except StoreError as error:
        console.print(f"[red]{error}[/red]")
        raise typer.Exit(2) from None


@app.command()
def runs(store_uri: str = typer.Argument(".marl/store", help="Experience store: a directory or s3://bucket/prefix.",
                                         metavar="STORE"),
         output: str = typer.Option("table", "--format", help="table, json or csv (for scripts).")) -> None:
    """The runs in a store: each agent's newest policy version, the launch's target step and state, last activity."""
    from dataclasses import asdict
    from datetime import datetime

    from marl_pipeline.run.launches import run_overview

    _check_format(output)
    store = _open_store(store_uri)
    _mark_dead_launches(quiet=output != "table")
    names = store.runs()
    if not names:
        console.print(f"[yellow]no runs in {store.uri}[/yellow]")
        raise typer.Exit(1)
    overviews = [run_overview(store, name) for name in names]
    if output != "table":
        _write_rows([asdict(run) for run in overviews], output)
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
    home = Path(os.environ.get("DAGSTER_HOME") or Path.cwd() / ".dagster_home")
    if not (home / "dagster.yaml").is_file():
        return
    import dagster as dg

    from assets.train import fail_dead_launches

    os.environ["DAGSTER_HOME"] = str(home.absolute())
    with dg.DagsterInstance.get() as instance:
        failed = fail_dead_launches(instance)
    if failed and not quiet:
        console.print(f"[yellow]marked failed in Dagster, their process gone: {', '.join(failed)}[/yellow]")


def _health_cell(health: dict[str, list[tuple[str, int]]]) -> str:
    """The agents under a collapse warning and since which step ("ok": none)."""
    return "; ".join(f"{agent} {what} since step {since}" for agent, signs in health.items()
                     for what, since in signs) or "ok"


@app.command()
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
    store = _open_store(store_uri)
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


def _print_run(store, run: str, step: int | None, agent: str | None, sample: int, wide: bool = False) -> None:
    from marl_pipeline.store.inspection import inspect_run, sample_episodes, text_histogram

    report = inspect_run(store, run, step, agent)
    scope = "".join(f", {k} {v}" for k, v in (("step", step), ("agent", agent)) if v is not None)
    versions = {a: max(store.policy_versions(run, a), default=None) for a in report["agents"]}
    console.print(f"[bold]run {run}[/bold]{scope}: {report['steps']} steps, {report['episodes']} episodes, "
                  f"{report['turns']} turns, {sum(a['tokens'] for a in report['agents'].values())} response tokens; "
                  f"policy versions {versions}")
    if step is None and agent is None:
        _print_reward_table(store, run)
        _print_evaluation_table(store, run)
        print_casts(store, run, console)
    _print_health_table(store, run, step, agent, wide)
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


if __name__ == "__main__":
    app()
