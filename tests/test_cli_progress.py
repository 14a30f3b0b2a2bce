"""The CLI's progress follower on a real Dagster instance: totals from the op's launch plan, set-up and step lines
from the run's log, reads by cursor.

No ``from __future__ import annotations``: Dagster checks the op's ``context`` annotation as an evaluated type.
"""

import threading
from pathlib import Path

import dagster as dg
import pytest

from assets.cli.train import _PolicyProgress
from assets.partitions import agent_key, stage_partition
from assets.train import SETUP_PREFIX, STEP_PREFIX, launch_line, plan_observations
from marl_pipeline.run.launches import LaunchPlan

# A resumed launch: it ends after step 4, the solver already holds version 3, the verifier version 2, so it
# has 5 policy versions left (solver 4, 5; verifier 3, 4, 5), not steps x agents.
PLAN = LaunchPlan(first_step=2, last_step=4, versions={"solver": 3, "verifier": 2}, resumed=True,
                  committed={"rollouts": 2})


def test_progress_total_comes_from_the_launch_plan_and_polls_read_only_new_records(tmp_path: Path) -> None:
    halfway, go_on = threading.Event(), threading.Event()

    @dg.op
    def launch(context: dg.OpExecutionContext) -> None:
        context.log.info(f"{SETUP_PREFIX}version 0 found in the store (0.1 s)")
        context.log.info("another line")
        for observation in plan_observations("r", PLAN):  # what the train op logs when its launch starts
            context.log_event(observation)
        context.log.info(launch_line("r", PLAN, 12.5))
        context.log_event(dg.AssetMaterialization("policies", partition=agent_key("r", "verifier")))
        context.log_event(dg.AssetMaterialization("rollouts", partition=str(stage_partition("r", 2, 0))))
        halfway.set()
        assert go_on.wait(60)
        for agent in ("solver", "verifier"):
            context.log_event(dg.AssetMaterialization("policies", partition=agent_key("r", agent)))
        context.log.info(f"{STEP_PREFIX}2: mean reward 0.500; step time 1.00 s, first rollout to commit 2.00 s")
        # A new layout after step 2 (run/layouts.py): the next launch of this job resumes at step 3, same target.
        for observation in plan_observations("r", LaunchPlan(3, 4, {"solver": 4, "verifier": 3}, True, {})):
            context.log_event(observation)

    @dg.job
    def launch_job() -> None:
        launch()

    instance = dg.DagsterInstance.local_temp(str(tmp_path))  # sqlite event log, as the CLI's DAGSTER_HOME
    run_id = "3f2c0a8e-0000-4000-8000-000000000001"
    worker = threading.Thread(target=lambda: launch_job.execute_in_process(instance=instance, run_id=run_id))
    worker.start()
    try:
        assert halfway.wait(60)
        progress = _PolicyProgress(instance, run_id)
        assert progress.poll() >= 6  # the set-up lines, 2 plan observations, 2 materializations, the run's events
        assert (progress.total, progress.done) == (5, 1)
        assert progress.lines == [f"{SETUP_PREFIX}version 0 found in the store (0.1 s)",  # and what the launch does
                                  "launch: run r, steps 2..4, resuming an unfinished launch at step 2 (already "
                                  "committed: rollouts 2); set-up took 12.5 s"]
        assert progress.poll() == 0  # nothing new since the cursor
        assert (progress.total, progress.done, progress.lines) == (5, 1, [])
    finally:
        go_on.set()
        worker.join()
    assert progress.poll() >= 5
    assert (progress.total, progress.done) == (5, 3)  # the later launch's versions were already counted
    assert progress.lines == [f"{STEP_PREFIX}2: mean reward 0.500; step time 1.00 s, first rollout to commit 2.00 s"]


def test_a_launch_marks_failed_the_earlier_runs_whose_process_died_and_only_those(tmp_path: Path) -> None:
    """Runs shown as started: one whose process is gone (a kill -9 of `marl train`) is marked failed with the
    launch that followed it named; one whose process still runs is left alone. The real kill is in
    test_orchestrator.py's kill-and-resume test."""
    import os
    import socket
    import subprocess
    import sys

    from assets.train import PROCESS_TAG, RUN_TAG, _fail_dead_predecessors

    instance = dg.DagsterInstance.local_temp(str(tmp_path))
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    host = socket.gethostname()
    for run_id, pid in (("0000dead-0000-4000-8000-000000000001", gone.pid),
                        ("0000a11e-0000-4000-8000-000000000002", os.getpid())):
        instance.add_run(dg.DagsterRun(job_name="train", run_id=run_id, status=dg.DagsterRunStatus.STARTED,
                                       tags={RUN_TAG: "r", PROCESS_TAG: f"{host}:{pid}"}))

    @dg.op
    def launch(context: dg.OpExecutionContext) -> None:
        _fail_dead_predecessors(context, "r", resumed=True)

    @dg.job
    def launch_job() -> None:
        launch()

    result = launch_job.execute_in_process(instance=instance, tags={RUN_TAG: "r"})
    dead, alive = (instance.get_run_by_id(run_id) for run_id in ("0000dead-0000-4000-8000-000000000001",
                                                                   "0000a11e-0000-4000-8000-000000000002"))
    assert (dead.status, alive.status) == (dg.DagsterRunStatus.FAILURE, dg.DagsterRunStatus.STARTED)
    messages = [record.event_log_entry.dagster_event.message for record in
                instance.get_records_for_run(dead.run_id).records if record.event_log_entry.dagster_event]
    assert any(f"resumed by Dagster run {result.run_id}" in (message or "") for message in messages)


@pytest.mark.launch
def test_the_sensor_and_marl_runs_mark_failed_a_dead_launch_without_waiting_for_the_next(tmp_path: Path) -> None:
    """A kill -9 of `marl train` leaves its Dagster run started: the always-on sensor and `marl runs` mark it failed
    (its process, named by the run's tag, is gone), a live one and one on another host stay as they are."""
    import os
    import socket
    import subprocess
    import sys

    from assets.retrain import mark_dead_launches
    from assets.train import PROCESS_TAG, RUN_TAG

    home = tmp_path / "home"
    home.mkdir()
    (home / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    host = socket.gethostname()
    runs = {"0000dead-0000-4000-8000-00000000000a": f"{host}:{gone.pid}",
            "0000a11e-0000-4000-8000-00000000000b": f"{host}:{os.getpid()}",
            "00000e15-0000-4000-8000-00000000000c": f"elsewhere:{gone.pid}"}
    with dg.DagsterInstance.from_config(str(home)) as instance:
        for run_id, process in runs.items():
            instance.add_run(dg.DagsterRun(job_name="train", run_id=run_id, status=dg.DagsterRunStatus.STARTED,
                                           tags={RUN_TAG: run_id[:8], PROCESS_TAG: process}))
        skipped = mark_dead_launches(dg.build_sensor_context(instance=instance))
        assert "marked failed: 0000dead-0000-4000-8000-00000000000a" in skipped.skip_message
        statuses = [instance.get_run_by_id(run_id).status for run_id in runs]
        assert statuses == [dg.DagsterRunStatus.FAILURE, dg.DagsterRunStatus.STARTED, dg.DagsterRunStatus.STARTED]
        again = subprocess.Popen([sys.executable, "-c", "pass"])
        again.wait()
        instance.add_run(dg.DagsterRun(job_name="train", run_id="0000dead-0000-4000-8000-00000000000d",
                                       status=dg.DagsterRunStatus.STARTED,
                                       tags={RUN_TAG: "d", PROCESS_TAG: f"{host}:{again.pid}"}))
    store = tmp_path / "store"
    store.mkdir()
    listed = subprocess.run([sys.executable, "-m", "assets.cli", "runs", str(store)], capture_output=True, text=True,
                            timeout=120, cwd=Path(__file__).resolve().parents[1],
                            env={**os.environ, "DAGSTER_HOME": str(home), "COLUMNS": "200"})
    assert "no runs" in listed.stdout  # an empty store: the command still checked Dagster's runs first
    with dg.DagsterInstance.from_config(str(home)) as instance:
        assert instance.get_run_by_id("0000dead-0000-4000-8000-00000000000d").status == dg.DagsterRunStatus.FAILURE


def test_a_launch_stopped_on_collapse_fails_its_job_with_what_the_cli_prints(tmp_path: Path) -> None:
    """The train op's failure on ``health.on_collapse: stop`` (issue 72.6), raised on a real Dagster instance: the
    run fails, and what the CLI prints of it names the agent, the committed version and how to resume."""
    from assets.cli.train import failure_messages
    from assets.train import collapse_failure
    from marl_pipeline.run.events import CollapseStopped

    stopped = CollapseStopped("demo", 6, ["verifier top answer share 0.99 (collapsing)"])

    @dg.op
    def launch() -> None:
        raise collapse_failure(stopped)

    @dg.job
    def train() -> None:
        launch()

    with dg.instance_for_test(temp_dir=str(tmp_path)) as instance:
        result = train.execute_in_process(instance=instance, raise_on_error=False)
        assert not result.success
        assert instance.get_run_by_id(result.run_id).status == dg.DagsterRunStatus.FAILURE
    (message,) = failure_messages(result)
    assert message == stopped.reason()
    assert message.startswith("run 'demo' stopped after step 6 (health.on_collapse: stop): verifier top answer")
    assert "agents.verifier.algorithm.advantage.type=dr_grpo" in message and "resumes from version 7" in message
