"""``marl train CONFIG`` runs the Dagster train job with a progress bar and a reward table; ``marl prepare CONFIG``
makes every agent's missing version 0. Heavy imports (Dagster, Ray, torch) happen after the arguments are parsed and
the config validated."""

from __future__ import annotations

import os
import threading
import time
import uuid
from pathlib import Path

import typer
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from assets.cli.output import RAY_INIT, console, dagster_home, quiet_libraries
from assets.cli.tables import print_evaluation_table, print_reward_table
from marl_pipeline.config import ConfigError, apply_settings, read_config_data


def _prepared_dagster_home() -> Path:
    """The Dagster home (output.dagster_home), made and set as DAGSTER_HOME, with telemetry off in a new one."""
    home = dagster_home()
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
    home = _prepared_dagster_home()
    # The progress bar and the reward table are the CLI's output: quiet the libraries' own bars and chatter
    # (set before Ray starts, so the engine and trainer actors inherit them). Errors still propagate.
    quiet_libraries()
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
        "ray": {"config": {"ray_init_options": RAY_INIT}},
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
        for message in failure_messages(result):
            console.print(message)
        raise typer.Exit(1)
    from marl_pipeline.store import ExperienceStore

    store = ExperienceStore(config.store)
    print_reward_table(store, config.run)
    print_evaluation_table(store, config.run)
    console.print(f"run {run_id} finished in {time.perf_counter() - started:.0f} s; DAGSTER_HOME={home}")



def failure_messages(result) -> list[str]:
    """What the CLI prints of a failed train job, a step failure each: a ``dg.Failure`` the op raised says what
    happened in its own words (``health.on_collapse: stop``: which agent, what was kept, how to resume); an error
    shows its trace."""
    messages = []
    for event in result.all_events:
        if event.is_step_failure and event.step_failure_data:
            failure, told = event.step_failure_data, event.step_failure_data.user_failure_data
            messages.append(told.description if told is not None and told.description else
                            failure.error.to_string() if failure.error else "")
    return messages


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
    quiet_libraries()
    started = time.perf_counter()
    with console.status(f"run {config.run}: making version 0 of {', '.join(missing)} (built-in model, warm-ups)"):
        import ray

        from marl_pipeline.bootstrap.policies import prepare_base_policies
        from marl_pipeline.environment import build_environment

        if not ray.is_initialized():
            ray.init(**(config.ray.local_init_options(RAY_INIT) if config.ray.address is None
                        else {"address": config.ray.address, **RAY_INIT}))
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
        self.options = config.ray.local_init_options(RAY_INIT)
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

