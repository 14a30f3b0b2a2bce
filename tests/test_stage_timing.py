"""Timing facts are stored with the data: the pipeline figures recomputed from the store match the live ones."""

from __future__ import annotations

from pathlib import Path

import pytest

from marl_pipeline.config import parse_config
from marl_pipeline.run.events import RunFinished
from marl_pipeline.run.pipeline_metrics import pipeline_report, spans_from_store, timeline_from_events
from marl_pipeline.run.recipe import train
from marl_pipeline.store import ExperienceStore
from tests.conftest import small_config_data

pytestmark = pytest.mark.launch
SHARES_WARM_ACTORS = True  # its launches take the engines and trainers the module before kept (conftest)


def test_spans_recomputed_from_the_store_equal_the_live_ones(local_ray, demo_config_data, tmp_path: Path) -> None:
    config = parse_config(small_config_data(demo_config_data, tmp_path / "store", steps=2, micro_batches_per_step=2,
                                            environment_concurrency=2))
    events = list(train(config))
    finished = events[-1]
    assert isinstance(finished, RunFinished)
    live = timeline_from_events(events).spans
    started, ended = finished.started, finished.ended
    stored = spans_from_store(ExperienceStore(config.store), "demo")
    key = lambda s: (s.stage, s.step, s.micro_batch, s.started)  # noqa: E731
    assert len(stored) == len(live) == 4 * 4 + 2 * 2
    for a, b in zip(sorted(stored, key=key), sorted(live, key=key)):
        assert (a.stage, a.step, a.micro_batch) == (b.stage, b.step, b.micro_batch)
        assert (a.enqueued, a.started, a.ended) == pytest.approx((b.enqueued, b.started, b.ended), abs=1e-5)
        assert a.enqueued <= a.started <= a.ended
    live_report = pipeline_report(live, steps=2, episodes=64, tokens=1, started=started, ended=ended)
    stored_report = pipeline_report(stored, steps=2, episodes=64, tokens=1, started=started, ended=ended)
    assert stored_report == pytest.approx(live_report, abs=1e-3)
