"""Run-level pipeline figures from stage timings: throughput, busy fractions, efficiency, overhead.

Every figure is computed from ``Span`` records (one per stage per micro-batch, plus one per agent per
optimizer step), which the orchestrator emits and the store keeps with the data, so they can be
recomputed after the fact.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

import pyarrow.compute as pc

from marl_pipeline.run.events import PolicyCommitted, StageCommitted, StepFinished
from marl_pipeline.stages.episodes import kept_turns

# Which resource a stage occupies: rollout engines, environment workers, the reward scorer, the trainers.
RESOURCE_OF_STAGE = {"rollouts": "engines", "environment_results": "environment", "rewards": "reward",
                     "policy_updates": "trainers", "optimizer_step": "trainers"}
STAGE_ORDER = ("rollouts", "environment_results", "rewards", "policy_updates", "optimizer_step")


@dataclass(frozen=True)
class Span:
    """One stage of one micro-batch (or one agent's optimizer step), in epoch seconds."""

    stage: str
    step: int
    micro_batch: int
    enqueued: float
    started: float
    ended: float


@dataclass(frozen=True)
class LaunchTimeline:
    """What a launch's events say about its pipeline: every span, and the rollout totals."""

    spans: list[Span]
    episodes: int
    tokens: int
    staleness: dict[int, int]
    """Turns sampled at each staleness (step - policy version)."""
    step_times: tuple[tuple[int, float, float], ...] = ()
    """Per finished step: (step, seconds since the previous one finished, seconds from its first rollout to its last
    commit), as ``StepFinished`` reports them."""


class TimelineRecorder:
    """Keeps what the run-level figures need of each event as it is yielded (spans, rollout totals), and
    nothing else: a long launch's events carry every committed table, which a caller must not hold on to."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.episodes = self.tokens = 0
        self._steps: list[int] = []
        self._versions: list[int] = []
        self._step_times: list[tuple[int, float, float]] = []

    def add(self, event: object) -> None:
        if isinstance(event, StageCommitted):
            t = event.timing
            self.spans.append(Span(event.stage, event.key.step, event.key.micro_batch, t.enqueued, t.started,
                                   t.ended))
            if event.stage == "rollouts":
                table = event.table
                self.episodes += len(pc.unique(kept_turns(table).column("episode")))  # not over-sampling's cut
                self.tokens += int(pc.sum(pc.list_value_length(table.column("response_ids"))).as_py() or 0)
                self._steps += [event.key.step] * table.num_rows
                self._versions += table.column("policy_version").to_pylist()
        elif isinstance(event, PolicyCommitted):
            t = event.timing
            self.spans.append(Span("optimizer_step", event.step, -1, t.enqueued, t.started, t.ended))
        elif isinstance(event, StepFinished):
            self._step_times.append((event.step, event.seconds, event.span_seconds))

    def timeline(self) -> LaunchTimeline:
        return LaunchTimeline(list(self.spans), self.episodes, self.tokens,
                              staleness_histogram(self._steps, self._versions), tuple(self._step_times))


def timeline_from_events(events) -> LaunchTimeline:
    """The spans and rollout totals of a launch, from the orchestrator's events as they were yielded."""
    recorder = TimelineRecorder()
    for event in events:
        recorder.add(event)
    return recorder.timeline()


def _union_length(intervals: list[tuple[float, float]]) -> float:
    total, current_start, current_end = 0.0, None, None
    for start, end in sorted(intervals):
        if current_end is None or start > current_end:
            if current_end is not None:
                total += current_end - current_start
            current_start, current_end = start, end
        else:
            current_end = max(current_end, end)
    if current_end is not None:
        total += current_end - current_start
    return total


def pipeline_report(spans: list[Span], *, steps: int, episodes: int, tokens: int, started: float,
                    ended: float) -> dict[str, float]:
    """Throughput, per-resource busy fraction and pipeline efficiency of one launch.

    Pipeline efficiency = ideal step time / measured step time, where the ideal step time is the busiest
    resource's total busy time per step (no pipeline can beat its bottleneck resource).
    """
    wall = max(ended - started, 1e-9)
    busy = {}
    for resource in sorted(set(RESOURCE_OF_STAGE.values())):
        intervals = [(s.started, s.ended) for s in spans if RESOURCE_OF_STAGE.get(s.stage) == resource]
        busy[resource] = _union_length(intervals)
    step_time = wall / max(steps, 1)
    ideal_step_time = max(busy.values(), default=0.0) / max(steps, 1)
    report = {
        "wall_s": round(wall, 3),
        "step_time_s": round(step_time, 4),
        "episodes_per_s": round(episodes / wall, 3),
        "tokens_per_s": round(tokens / wall, 1),
        "pipeline_efficiency": round(ideal_step_time / step_time, 4) if step_time else 0.0,
    }
    for resource, seconds in busy.items():
        report[f"busy_fraction/{resource}"] = round(seconds / wall, 4)
    return report


def staleness_histogram(steps: list[int], versions: list[int]) -> dict[int, int]:
    """How many turns were sampled at each staleness (step - policy version)."""
    histogram: dict[int, int] = {}
    for step, version in zip(steps, versions):
        histogram[step - version] = histogram.get(step - version, 0) + 1
    return dict(sorted(histogram.items()))


def orchestrator_overhead(spans: list[Span], concurrency: dict[str, int] | None = None,
                          synchronous: bool = False) -> float:
    """Mean time per micro-batch spent in neither stage work nor waiting on a busy resource.

    For each stage after rollout: the moments when a micro-batch's input was committed and a worker of
    the stage's resource sat idle, yet the stage had not started it, are time the orchestrator itself
    added (queueing, polling, dispatch). Idle moments count once per resource, however many
    micro-batches were waiting. A trainer's optimizer step keeps the trainers busy; in ``synchronous``
    mode a stage's input is ready only when the whole step's previous stage is (the barrier is the mode,
    not overhead).
    """
    concurrency = concurrency or {}
    chain = [stage for stage in STAGE_ORDER if stage != "optimizer_step"]
    total, micro_batches = 0.0, {(s.step, s.micro_batch) for s in spans if s.stage == chain[0]}
    for stage in chain[1:]:
        resource = RESOURCE_OF_STAGE[stage]
        busy = [(s.started, s.ended) for s in spans if RESOURCE_OF_STAGE.get(s.stage) == resource]
        waiting = []
        for span in (s for s in spans if s.stage == stage):
            before = [s for s in spans if s.stage == chain[chain.index(stage) - 1] and s.step == span.step
                      and (synchronous or s.micro_batch == span.micro_batch)]
            if before:
                waiting.append((max(s.ended for s in before), span.started))
        total += _idle_while_waiting(busy, waiting, concurrency.get(stage, 1))
    return total / max(len(micro_batches), 1)


def _idle_while_waiting(busy: list[tuple[float, float]], waiting: list[tuple[float, float]], workers: int) -> float:
    """Length of the time when fewer than ``workers`` spans were busy and at least one item was waiting."""
    events = sorted({t for interval in busy + waiting for t in interval})
    idle = 0.0
    for start, end in pairwise(events):
        middle = (start + end) / 2
        running = sum(1 for a, b in busy if a <= middle < b)
        queued = any(a <= middle < b for a, b in waiting)
        if queued and running < workers:
            idle += end - start
    return idle


def spans_from_store(store, run: str, timings: dict[tuple[str, int], dict] | None = None) -> list[Span]:
    """Every stage span of a run, recomputed from the timing columns and policy checkpoints in the store
    (``timings``: :func:`version_timings`, when the caller has read them already)."""
    spans = []
    for stage in ("rollouts", "environment_results", "rewards", "policy_updates"):
        columns = ["step", "micro_batch", "stage_enqueued", "stage_started", "stage_ended"]
        table = store.read_stage(run, stage, columns=columns)
        table = table.filter(pc.is_valid(table.column("stage_started")))  # files older than schema v3 lack them
        for row in table.group_by(columns).aggregate([]).to_pylist():
            spans.append(Span(stage, row["step"], row["micro_batch"], row["stage_enqueued"].timestamp(),
                              row["stage_started"].timestamp(), row["stage_ended"].timestamp()))
    for record in (version_timings(store, run) if timings is None else timings).values():
        spans.append(Span("optimizer_step", record["step"], -1, record["enqueued"], record["started"],
                          record["ended"]))
    return spans


def version_timings(store, run: str) -> dict[tuple[str, int], dict]:
    """Each committed policy version's ``timing.json`` record by (agent, version): its step's end as the publisher
    timed it. A base policy, or a version saved before timings were recorded, has none."""
    import json

    agents = {row["agent"] for row in store.read_stage(run, "policy_updates", columns=["agent"]).to_pylist()}
    timings = {}
    for agent in sorted(agents):
        for version in store.policy_versions(run, agent):
            if (data := store.policy_file(run, agent, version, "timing.json")) is not None:
                timings[(agent, version)] = json.loads(data)
    return timings
