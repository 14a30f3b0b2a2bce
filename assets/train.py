"""The ``train`` job: one streaming orchestrator run, recorded into Dagster as it goes.

Dagster stays on the control plane: the orchestrator moves data through the store on Ray, and this op
turns each commit into an ``AssetMaterialization`` of that stage partition (about 2 ms each) the
moment it lands, so the UI's partition grid fills in live.
"""

import os
import socket
from typing import TYPE_CHECKING

import dagster as dg

from assets.evaluations import evaluation_metadata
from assets.health import collapse_evaluation, health_metadata
from assets.metadata import run_plots, run_report, stage_metadata
from assets.partitions import (
    AGENTS,
    RUNS,
    STEPS,
    add_planned_stage_partitions,
    agent_key,
    stage_partition,
    step_key,
)
from assets.plots import images_markdown
from assets.policies import base_policy_metadata
from assets.previews import PREVIEW_COLUMNS
from marl_pipeline.services.figures import describe as describe_service
from marl_pipeline.stages.health import groups_note, started_warnings
from resources import SETUP_PREFIX, ExperimentResource, RayCluster

if TYPE_CHECKING:
    from marl_pipeline.run.events import CollapseStopped

RUN_TAG = "marl/run"
"""The Dagster tag that names the training run a launch belongs to."""
PROCESS_TAG = "marl/process"
"""The Dagster tag that names the host and process id a launch's op runs in."""
STEP_PREFIX = "step "
"""What a finished step's line starts with in the run's log: the ``marl`` CLI prints those too."""
LAUNCH_PREFIX = "launch: "
"""What the line saying what a launch does (new, continued, resumed at step N) starts with: the CLI prints it too."""


@dg.op(description="Stream micro-batches through rollout, environment, reward and train on Ray.",
       out=dg.Out(dict, description="Run-level pipeline figures of the launch."))
def stream_training(context: dg.OpExecutionContext, experiment: ExperimentResource, ray: RayCluster):
    from marl_pipeline.cluster.heap import collector_paused

    with collector_paused():  # torch's import, among others (marl_pipeline/cluster/heap.py)
        from marl_pipeline.run.cards import card_summary
        from marl_pipeline.run.events import (
            CollapseStopped,
            EvaluationCommitted,
            LayoutChanged,
            PolicyCommitted,
            ReplicaChanged,
            RunFinished,
            RunStarted,
            SetupPhase,
            StageCommitted,
            StepFinished,
            ThreadsChanged,
            TrainerPasses,
            describe_passes,
            mean_reward,
        )
        from marl_pipeline.run.launches import launch_history
        from marl_pipeline.run.pipeline_metrics import TimelineRecorder
        from marl_pipeline.run.provenance import ServedVersions, covering_launches
        from marl_pipeline.run.recipe import train
        from marl_pipeline.store import ExperienceStore

    config = experiment.load()
    store = ExperienceStore(config.store)  # read-only here: the previews' rollouts and the run's plots
    instance = context.instance
    # How the next launch of the run finds this one, and tells whether its process still lives.
    instance.add_run_tags(context.run_id, {RUN_TAG: config.run, PROCESS_TAG: f"{socket.gethostname()}:{os.getpid()}"})
    instance.add_dynamic_partitions(AGENTS.name, [agent_key(config.run, agent) for agent in config.agents])
    instance.add_dynamic_partitions(RUNS.name, [config.run])
    timeline = TimelineRecorder()  # what the run report needs of each event; the events themselves are dropped
    reported: list[str] = []  # the last step's collapse warnings (the health check still fails on every step)
    previews: dict = {}  # per micro-batch, its committed rollouts' text columns until its rewards commit
    # Each version's card summary from the launch's own rollouts and launch record: no read per version.
    served, launches = ServedVersions(store, config.run, config.pipeline.micro_batches_per_step), []
    passes: list[TrainerPasses] = []  # told by each trainer with its first step; logged together once it finishes
    for event in train(config, launch_id=context.run_id):
        timeline.add(event)
        if isinstance(event, StageCommitted):
            key = event.key
            # A rewards partition's episode preview shows the conversation with its rewards: the micro-batch's
            # rollouts, committed before (their event's table; read from the store if this launch resumed past them).
            if event.stage == "rollouts":
                previews[key] = event.table.select(PREVIEW_COLUMNS)
                served.add(key, event.table)
            rollouts = (previews.pop(key, None) or store.read("rollouts", key, columns=PREVIEW_COLUMNS)
                        if event.stage == "rewards" else None)
            context.log_event(dg.AssetMaterialization(
                asset_key=event.stage, partition=stage_partition(key.run, key.step, key.micro_batch),
                metadata=stage_metadata(event.stage, event.path, event.seconds, event.table, rollouts)))
        elif isinstance(event, PolicyCommitted):
            teammates = {name: found for name, found in served.at(event.step).items() if name != event.agent}
            card = card_summary(config.run, event.agent, event.version, config.agents[event.agent].model, event.tokens,
                                teammates, covering_launches(launches, event.version))
            context.log_event(dg.AssetMaterialization(
                asset_key="policies", partition=agent_key(config.run, event.agent),
                metadata={"policy_version": event.version, "step": event.step,
                          "path": dg.MetadataValue.path(str(event.path)), "grad_norm": event.grad_norm,
                          "tokens": event.tokens, "sync_seconds": event.sync_seconds,
                          "trainer_computed_tokens": event.computed_tokens,
                          "trainer_tokens_per_s": round(event.tokens_per_second, 1),
                          "mfu_percent": round(100 * event.mfu, 3), "card": dg.MetadataValue.md(card)}))
        elif isinstance(event, TrainerPasses):
            passes.append(event)
        elif isinstance(event, EvaluationCommitted):
            _log_evaluation(context, config, event)
        elif isinstance(event, StepFinished):
            for line in describe_passes(passes):
                context.log.info(f"{STEP_PREFIX}{event.step}: {line}")
            passes.clear()
            rewards = ", ".join(f"{agent} {value:.3f}" for agent, value in event.mean_reward.items())
            context.log.info(f"{STEP_PREFIX}{event.step}: mean reward {mean_reward(event.mean_reward):.3f} "
                             f"({rewards}); step time {event.seconds:.2f} s, first rollout to commit "
                             f"{event.span_seconds:.2f} s{groups_note(event.health)}")
            for name, figures in event.services.items():
                context.log.info(f"{STEP_PREFIX}{event.step}: service {name}: {describe_service(figures)}")
            context.log_event(dg.AssetMaterialization(asset_key="health", partition=step_key(config.run, event.step),
                                                      metadata=health_metadata(event.health)))
            context.log_event(collapse_evaluation(config.run, event.step, event.warnings, config.health))
            served.forget(event.step)  # every agent has committed past it
            # Logged (and so on the `marl` CLI) as a streak starts, not at each of its steps, which can be dozens; the
            # health check fails at every one of them.
            for warning in started_warnings(reported, event.warnings):
                context.log.warning(f"{STEP_PREFIX}{event.step}: {warning} (not repeated while it lasts)")
            reported = event.warnings
        elif isinstance(event, ReplicaChanged):
            _log_replica(context, event)
        elif isinstance(event, LayoutChanged):
            moved = "; ".join(f"{agent} {before} -> {after} (its longest turn {event.lengths[agent]:,} tokens)"
                              for agent, (before, after) in event.changed.items())
            context.log.info(f"{STEP_PREFIX}{event.step}: new layout from step {event.step + 1}: {moved}; the "
                             f"launch resumes in it")
        elif isinstance(event, ThreadsChanged):
            moved = ", ".join(f"{name} {old} -> {new}" for name, (old, new) in event.changed.items())
            used = ", ".join(f"{name} {cores:.2f}" for name, cores in sorted(event.cores.items()))
            context.log.info(f"{STEP_PREFIX}{event.step}: threads {moved} (cores each used in the step: {used})")
        elif isinstance(event, SetupPhase):
            context.log.info(f"{SETUP_PREFIX}{event.name} ({event.seconds:.1f} s)")
        elif isinstance(event, RunStarted):
            launches = launch_history(store, config.run)[0]  # planned: this launch is in it
            _fail_dead_predecessors(context, config.run, event.plan.resumed)
            _log_start(context, config, event)
        elif isinstance(event, CollapseStopped):  # the Dagster run fails with the reason; the launch resumes later
            raise collapse_failure(event)
        elif isinstance(event, RunFinished):
            launch = timeline.timeline()
            report, metadata = run_report(event, launch)
            plots = images_markdown(run_plots(store, config.run, event, launch))
            context.log_event(dg.AssetMaterialization(asset_key="training_runs", partition=config.run,
                                                      metadata={"plots": plots, **metadata}))
            return dg.Output(report, metadata=metadata)
    raise RuntimeError("the training launch ended without finishing")  # unreachable: train() raises first


def collapse_failure(event: "CollapseStopped") -> dg.Failure:
    """The train op's failure when a launch stops on collapse: the reason as its description, what a user reads in
    the Dagster UI and the CLI prints."""
    return dg.Failure(description=event.reason(), metadata={"step": event.step, "agents": ", ".join(event.agents)})


def _fail_dead_predecessors(context: dg.OpExecutionContext, run: str, resumed: bool) -> None:
    """Mark failed every earlier Dagster run of this training run still shown as started: its process died (a
    kill -9 leaves no failure event), since a run's launches never overlap (each plans from the launch record)."""
    what = "resumed" if resumed else "followed"
    for dagster_run, _, alive in started_launches(context.instance, run):
        if dagster_run.run_id == context.run_id:
            continue
        if alive:
            context.log.warning(f"Dagster run {dagster_run.run_id} of run {run!r} is still running (process "
                                f"{dagster_run.tags[PROCESS_TAG]}): two launches of one run at once write over each "
                                f"other's plan")
            continue
        context.instance.report_run_failed(dagster_run, message=f"its process died: run {run!r} was {what} by Dagster "
                                                                f"run {context.run_id}")
        context.log.warning(f"Dagster run {dagster_run.run_id} of run {run!r} was shown as started, but its process "
                            f"died; marked failed")


def started_launches(instance: dg.DagsterInstance, run: str | None = None) -> list[tuple]:
    """The train-job runs (of training run ``run``, or every one) shown as started: (the run, the host its process
    tag names or "", whether that process lives on this host)."""
    tags = {RUN_TAG: run} if run is not None else {}
    started = instance.get_runs(filters=dg.RunsFilter(
        job_name="train", tags=tags, statuses=[dg.DagsterRunStatus.STARTED, dg.DagsterRunStatus.STARTING]))
    found = []
    for dagster_run in started:
        host, _, pid = dagster_run.tags.get(PROCESS_TAG, "").partition(":")
        found.append((dagster_run, host, host == socket.gethostname() and pid.isdigit() and _alive(int(pid))))
    return found


def fail_dead_launches(instance: dg.DagsterInstance) -> list[str]:
    """Mark failed the train-job runs shown as started whose process on this host is gone (a kill -9 leaves no
    failure event): what the `mark_dead_launches` sensor and `marl runs` do without waiting for the run's next
    launch. A run without a process tag (killed before its op began) is left to that launch. -> their run ids."""
    failed = []
    for dagster_run, host, alive in started_launches(instance):
        if alive or host != socket.gethostname():  # another host's processes are not visible from here
            continue
        instance.report_run_failed(dagster_run, message=f"its process ({dagster_run.tags[PROCESS_TAG]}) died")
        failed.append(dagster_run.run_id)
    return failed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # no signal sent: only whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, under another user
        return True
    return True


def _log_evaluation(context: dg.OpExecutionContext, config, event) -> None:
    """One ``evaluations`` materialization per evaluated version (key ``<run>-<version>``, registered when the
    launch started), with every agent's metrics and the plot across the run's versions."""
    from marl_pipeline.run.evaluations import evaluation_history
    from marl_pipeline.store import ExperienceStore

    partition = step_key(config.run, event.version)
    history = evaluation_history(ExperienceStore(config.store), config.run)
    context.log_event(dg.AssetMaterialization(asset_key="evaluations", partition=partition,
                                              metadata=evaluation_metadata(event.metrics, event.path, history)))
    figures = "; ".join(f"{agent} " + ", ".join(f"{name} {value:.3f}" for name, value in metrics.items())
                        for agent, metrics in event.metrics.items())
    context.log.info(f"held-out evaluation of version {event.version}: {figures}")


def _log_replica(context: dg.OpExecutionContext, event) -> None:
    """A replica's death and restart: warnings in the run's log (and on the `marl` CLI, which shows warnings), since
    the run goes on without it; a failed restart is an error, though the agent's other replicas still serve."""
    name = f"engine replica {event.agent}/{event.replica}"
    if event.state == "down":
        context.log.warning(f"{name} died; its requests go to the agent's other replicas"
                            + (f" ({event.detail})" if event.detail else " while it is restarted"))
    elif event.state == "up":
        context.log.warning(f"{name} restarted; it serves policy version {event.version} again")
    else:
        context.log.error(f"{name} could not be restarted and stays down: {event.detail}")


def _log_start(context: dg.OpExecutionContext, config, event) -> None:
    plan = event.plan
    # The grid lists what the launch planned, registered before its first commit is logged: its micro-batches,
    # and the policy versions it starts from or commits (the `evaluations` asset's keys, evaluable from the UI).
    add_planned_stage_partitions(context.instance, config.run, plan.first_step, plan.last_step,
                                 config.pipeline.micro_batches_per_step)
    context.instance.add_dynamic_partitions(
        STEPS.name, [step_key(config.run, version) for version in range(plan.first_step, plan.last_step + 2)])
    for observation in plan_observations(config.run, plan):
        context.log_event(observation)
    if any(policy.created for policy in event.base_policies):
        context.log_event(dg.AssetMaterialization(asset_key="base_policies",
                                                  metadata=base_policy_metadata(event.base_policies)))
    context.log.info(launch_line(event.run, plan, event.setup_seconds))


def launch_line(run: str, plan, setup_seconds: float) -> str:
    """What the launch does, in the run's log as it starts (and on the `marl` CLI: :data:`LAUNCH_PREFIX`)."""
    if plan.resumed:
        done = ", ".join(f"{stage} {count}" for stage, count in plan.committed.items())
        where = f"resuming an unfinished launch at step {plan.first_step} (already committed: {done})"
    else:
        where = "a new run" if plan.first_step == 0 else f"continuing from policy versions {plan.versions}"
    return (f"{LAUNCH_PREFIX}run {run}, steps {plan.first_step}..{plan.last_step}, {where}; "
            f"set-up took {setup_seconds:.1f} s")


def plan_observations(run: str, plan) -> list[dg.AssetObservation]:
    """One ``policies`` observation per agent: the policy versions this launch will commit (from, to].

    The plan is made inside the op (it reads and writes the store's launch record), so the op records it in
    the event log and the ``marl`` CLI takes its progress total from there (``cli._PolicyProgress``): a resumed
    launch's total is what it has left, and no second planning outside the op can disagree with the op's.
    """
    return [dg.AssetObservation(asset_key="policies", partition=agent_key(run, agent),
                                metadata={"launch_from_version": version, "launch_to_version": plan.last_step + 1,
                                          "launch_resumed": plan.resumed})
            for agent, version in plan.versions.items()]


# Recorded by the train job when a launch finishes (one materialization per launch, keyed by run name), so a
# run's plots have a page in the UI: its partition's metadata. Not materialized on its own.
training_runs = dg.AssetSpec(
    "training_runs",
    partitions_def=RUNS,
    group_name="runs",
    deps=["policies", "rewards"],
    description="Each run's figures and plots, recorded when a launch of it finishes: mean reward per agent per "
                "step, turns per step by staleness, held-out evaluation per policy version (when evaluated), the "
                "launch's stage activity, throughput and busy fractions.",
)


@dg.job(name="train", description="Train every agent for `pipeline.steps` RL steps, continuing from the latest "
                                   "committed policies.")
def train_job():
    stream_training()


retrain_schedule = dg.ScheduleDefinition(
    name="retrain",
    job=train_job,
    cron_schedule="0 */6 * * *",
    default_status=dg.DefaultScheduleStatus.STOPPED,
    description="Periodic retraining: each tick continues from the latest committed policies.",
)
