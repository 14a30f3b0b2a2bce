"""Cores shared by the compute actors working now (policy/cores.py): each takes floor(cores * weight / busy
weights), at least 1; a dead actor's slot stops counting."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from marl_pipeline.policy import cores
from marl_pipeline.policy.cores import CoreShare


@pytest.fixture(autouse=True)
def _rescan_every_call(monkeypatch) -> None:
    monkeypatch.setattr(cores, "RESCAN_S", -1.0)


def test_threads_follow_the_actors_working_now(tmp_path: Path) -> None:
    before = torch.get_num_threads()
    try:
        engine, trainer, other = (CoreShare(tmp_path, 4, 1.0), CoreShare(tmp_path, 4, 1.0),
                                  CoreShare(tmp_path, 4, 2.0))
        assert engine.working(True) == 4 and torch.get_num_threads() == 4  # alone: every core
        assert trainer.working(True) == 2  # two of weight 1 working: half each
        assert engine.take() == 2
        assert other.working(True) == 2 and engine.take() == 1  # 4 * 2 / 4 and 4 * 1 / 4
        trainer.working(False)
        other.working(False)
        assert engine.take() == 4
        other.close()
        assert len(list(tmp_path.iterdir())) == 2
    finally:
        torch.set_num_threads(before)


def test_a_dead_actors_slot_stops_counting(tmp_path: Path) -> None:
    code = (f"from marl_pipeline.policy.cores import CoreShare; CoreShare({str(tmp_path)!r}, 2, 1.0).working(True)")
    subprocess.run([sys.executable, "-c", code], check=True)
    assert len(list(tmp_path.iterdir())) == 1  # its slot, left busy by a process that died without closing
    share = CoreShare(tmp_path, 2, 1.0)
    assert share.threads() == 2 and len(list(tmp_path.iterdir())) == 1  # the dead one's slot is gone


def test_a_bad_share_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"cores >= 1 and weight > 0, got 0 and 1\.0"):
        CoreShare(tmp_path, 0, 1.0)
