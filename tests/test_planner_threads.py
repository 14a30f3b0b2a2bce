"""What a trainer's threads buy in the planner (marl_pipeline/planner/threads.py): a measured thread profile read and
checked, jobs on shared cores going as fast as it says, what crowded cores lose, and a calibrated call given back at
the threads it ran on."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pytest
import simpy

from marl_pipeline.planner.shared_cores import SharedCores
from marl_pipeline.planner.threads import AgentThreads, ThreadScaling, thread_profile


def _run(jobs: list[tuple[float, int, float | None]], cores: float,
         crowding: float = 0.0) -> tuple[list[float], float]:
    """When each (core-seconds, threads, speed-up) job started at 0 ends on ``cores`` cores; the core-seconds held."""
    env = simpy.Environment()
    shared, ends = SharedCores(env, cores, crowding), {}

    def job(index: int, work: float, threads: int, speedup: float | None):
        yield shared.compute(work, threads, "trainers", speedup)
        ends[index] = env.now

    for index, (work, threads, speedup) in enumerate(jobs):
        env.process(job(index, work, threads, speedup))
    env.run()
    return [ends[index] for index in range(len(jobs))], shared.busy_core_seconds


def test_a_job_goes_as_fast_as_its_threads_speed_up_and_holds_all_of_them() -> None:
    # 3 s of one thread's work on 2 threads at 1.5x: 2 s, both cores held throughout
    assert _run([(3.0, 2, 1.5)], cores=2) == (pytest.approx([2.0]), pytest.approx(4.0))
    assert _run([(3.0, 2, None)], cores=2) == (pytest.approx([1.5]), pytest.approx(3.0))  # no profile: linear
    # beside a one-thread job: 3 threads on 2 cores, each at 2/3 of a core; the 2-thread job's work goes at
    # 1.5 x 2/3 = 1 a second, the other's at 2/3
    ends, held = _run([(1.0, 2, 1.5), (1.0, 1, None)], cores=2)
    assert ends == pytest.approx([1.0, 1 + 1 / 3])  # then the one-thread job alone: its last 1/3 on a full core
    assert held == pytest.approx(2.0 + 1 / 3)


def test_crowded_cores_do_less_work_a_core_second_and_threads_that_fit_lose_nothing() -> None:
    # two one-thread jobs of 1 core-second on 1 core: half a core each; crowding 1 halves what that half does
    assert _run([(1.0, 1, None), (1.0, 1, None)], cores=1) == (pytest.approx([2.0, 2.0]), pytest.approx(2.0))
    assert _run([(1.0, 1, None), (1.0, 1, None)], cores=1, crowding=1.0) == (pytest.approx([4.0, 4.0]),
                                                                              pytest.approx(4.0))
    # 3 threads on 2 cores at crowding 0.5: (2/3) ** 0.5 of the work a core-second, until the short job ends
    efficiency = (2 / 3) ** 0.5
    ends, _ = _run([(0.5, 1, None), (2.0, 2, None)], cores=2, crowding=0.5)
    first = 0.5 / (2 / 3 * efficiency)
    assert ends == pytest.approx([first, first + (2.0 - 4 / 3 * efficiency * first) / 2])  # then alone on both
    assert _run([(1.0, 2, None)], cores=2, crowding=1.0)[0] == pytest.approx([0.5])  # fits: no loss
    crowded = ThreadScaling(crowding=0.5)
    assert crowded.efficiency(0.25) == pytest.approx(0.5) and crowded.efficiency(1.0) == 1.0
    assert "** 0.5" in crowded.describe() and "without loss" in ThreadScaling().describe()


def test_the_speed_up_is_the_profiles_and_beyond_it_keeps_the_last_speed_up_per_thread() -> None:
    linear = ThreadScaling()
    assert [linear.speedup(t) for t in (0, 1, 2, 8)] == [1.0, 1.0, 2.0, 8.0]
    measured = ThreadScaling((1.0, 1.5), "here.json")
    assert [measured.speedup(t) for t in (1, 2, 4)] == [1.0, 1.5, 3.0]
    assert "evenly" in linear.describe() and "here.json" in measured.describe() and "2: 1.50x" in measured.describe()


def test_a_profile_is_read_relative_to_one_thread_and_a_malformed_one_is_refused(tmp_path: Path) -> None:
    good = tmp_path / "threads.json"
    good.write_text(json.dumps({"cpu": "x", "trainer": {"2": 1.2, "1": 0.8}}))
    read = thread_profile(good)
    assert read.trainer == pytest.approx((1.0, 1.5)) and read.source == str(good) and read.crowding == 0.0
    good.write_text(json.dumps({"cpu": "x", "trainer": {"1": 1.0}, "crowding": 0.1}))
    assert thread_profile(good).crowding == 0.1
    for name, data, message in [
            ("crowded.json", {"trainer": {"1": 1.0}, "crowding": -0.1}, r"crowding -0.1 is not a number from 0 to 2"),
            ("crowded2.json", {"trainer": {"1": 1.0}, "crowding": "high"}, r"crowding 'high' is not a number"),
            ("missing.json", {"engine": {"1": 1.0}}, r"missing.json: expected JSON with a \"trainer\" object"),
            ("skipped.json", {"trainer": {"1": 1.0, "3": 2.0}}, r"threads \[1, 3\]; expected 1, 2, ... with none"),
            ("negative.json", {"trainer": {"1": 1.0, "2": 0.0}}, r"speed-ups at threads \[2\] are not positive"),
            ("words.json", {"trainer": {"one": 1.0}}, r"words.json: expected JSON")]:
        (tmp_path / name).write_text(json.dumps(data))
        with pytest.raises(ValueError, match=message):
            thread_profile(tmp_path / name)
    with pytest.raises(ValueError, match=r"nothing\.json: expected JSON"):
        thread_profile(tmp_path / "nothing.json")


def test_a_calls_measured_seconds_come_back_on_its_threads_and_its_work_follows_the_profile() -> None:
    """The calibration turns a 2-thread trainer's call seconds into one thread's work by the profile's speed-up; the
    simulation runs that work on 2 threads at the same speed-up, so the call takes its measured seconds again, and
    on one thread the speed-up times as long."""
    from marl_pipeline.planner.costs import _trainer_costs

    stamp = pa.timestamp("us", tz="UTC")
    seconds = {(0, 0): 0.30, (0, 1): 0.50}  # two calls, of 100 and 300 tokens
    updates = pa.table({"step": [0, 0], "micro_batch": [0, 1], "agent": ["a", "a"],
                        "stage_started": pa.array([10_000_000, 11_000_000], stamp),
                        "stage_ended": pa.array([10_600_000, 11_600_000], stamp),
                        "compute_seconds": [seconds[(0, 0)], seconds[(0, 1)]]})
    computed = {(0, 0, "a"): 100, (0, 1, "a"): 300}
    layout = AgentThreads(1, 2, 1, "a/trainer", True)
    for scaling in (ThreadScaling(), ThreadScaling((1.0, 1.5))):
        costs = _trainer_costs(updates, "a", layout, computed, [], [], {}, scaling.speedup(2))
        for (_, mb), measured in seconds.items():
            work = costs.call + costs.per_token * computed[(0, mb, "a")]
            assert _run([(work, 2, scaling.speedup(2))], cores=2)[0] == pytest.approx([measured])
            assert _run([(work, 1, None)], cores=2)[0] == pytest.approx([measured * scaling.speedup(2)])
