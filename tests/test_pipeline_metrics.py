"""Pipeline figures from stage timings, on hand-built timelines."""

from __future__ import annotations

import pytest

from assets.plots import activity_png
from marl_pipeline.run.pipeline_metrics import (
    Span,
    orchestrator_overhead,
    pipeline_report,
    staleness_histogram,
)


def _chain(step: int, mb: int, start: float, gaps: float = 0.0) -> list[Span]:
    """One micro-batch through the four stages, 1 s each, with `gaps` seconds between stages."""
    spans, t = [], start
    for stage in ("rollouts", "environment_results", "rewards", "policy_updates"):
        spans.append(Span(stage, step, mb, t, t, t + 1.0))
        t += 1.0 + gaps
    return spans


def test_report_by_hand() -> None:
    spans = _chain(0, 0, 0.0) + _chain(0, 1, 1.0)  # perfectly pipelined: micro-batch 1 starts as 0 moves on
    report = pipeline_report(spans, steps=1, episodes=10, tokens=100, started=0.0, ended=5.0)
    assert report["episodes_per_s"] == pytest.approx(2.0)
    assert report["busy_fraction/engines"] == pytest.approx(2 / 5)
    # every resource works 2 s of the 5 s step: ideal step time 2 s
    assert report["pipeline_efficiency"] == pytest.approx(2 / 5)


def test_overhead_counts_gaps_not_waiting_on_a_busy_resource() -> None:
    assert orchestrator_overhead(_chain(0, 0, 0.0, gaps=0.25)) == pytest.approx(0.75)
    # micro-batch 1's rollout ends at 2 but the environment is busy with micro-batch 0 until 3: waiting, not overhead
    spans = [Span("rollouts", 0, 0, 0, 0, 1), Span("environment_results", 0, 0, 1, 1, 3),
             Span("rollouts", 0, 1, 1, 1, 2), Span("environment_results", 0, 1, 2, 3, 4)]
    assert orchestrator_overhead(spans) == pytest.approx(0.0)
    # with two environment workers micro-batch 1 could have started at 2: 1 s of overhead, 0.5 s per micro-batch
    assert orchestrator_overhead(spans, {"environment_results": 2}) == pytest.approx(0.5)


def test_staleness_histogram_and_plot() -> None:
    assert staleness_histogram([3, 3, 4, 4], [3, 2, 3, 4]) == {0: 2, 1: 2}
    png = activity_png(_chain(0, 0, 0.0) + _chain(1, 0, 4.0), started=0.0)
    assert png.startswith(b"\x89PNG")


def test_overhead_excludes_the_trainers_optimizer_step_and_the_synchronous_barrier() -> None:
    # micro-batch 1's gradient waits for the trainer's optimizer step (1..2): waiting on the resource
    spans = [Span("rewards", 0, 1, 0, 0, 1), Span("optimizer_step", 0, -1, 1, 1, 2),
             Span("policy_updates", 0, 1, 1, 2, 3)]
    assert orchestrator_overhead(spans) == pytest.approx(0.0)
    # synchronous: micro-batch 0's environment waits for micro-batch 1's rollout (the barrier), then starts
    # 0.5 s late: 0.5 s of overhead over 2 micro-batches; without the barrier it was ready at 1: 1.5 s
    spans = [Span("rollouts", 0, 0, 0, 0, 1), Span("rollouts", 0, 1, 1, 1, 2),
             Span("environment_results", 0, 0, 2, 2.5, 3)]
    assert orchestrator_overhead(spans, synchronous=True) == pytest.approx(0.25)
    assert orchestrator_overhead(spans) == pytest.approx(0.75)


def test_step_times_reach_the_run_report() -> None:
    """Each step's time (end to end of consecutive steps) and span (first rollout to commit) as reported, and their
    means in the run's metadata, as a table too."""
    from types import SimpleNamespace

    from assets.metadata import run_report
    from marl_pipeline.cluster.placement import PlacementPlan
    from marl_pipeline.run.events import StepFinished
    from marl_pipeline.run.launches import LaunchPlan
    from marl_pipeline.run.pipeline_metrics import TimelineRecorder

    recorder = TimelineRecorder()
    recorder.add(StepFinished(0, {"solver": 1.0}, 4.0, 4.0))
    recorder.add(StepFinished(1, {"solver": 1.0}, 2.0, 6.0))
    timeline = recorder.timeline()
    assert timeline.step_times == ((0, 4.0, 4.0), (1, 2.0, 6.0))
    finished = SimpleNamespace(plan=LaunchPlan(0, 1, {"solver": 0}, False, {}), started=0.0, ended=6.0,
                               placement=PlacementPlan([], {}))
    report, metadata = run_report(finished, timeline)
    assert (report["mean_step_seconds"], report["mean_step_span_seconds"]) == (3.0, 5.0)
    assert metadata["mean_step_seconds"].value == 3.0
    assert "| 1 | 2.00 | 6.00 |" in metadata["step_times"].value
