"""Hedged execution in the action pool, on real Ray: a stalled attempt gets a duplicate copy that decides the
outcome, the losing copy's worker is killed, queued actions go before hedges and the pool stays within max_workers."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import ray

from marl_pipeline.actions.pool import ActionPool
from marl_pipeline.actions.worker import Job
from marl_pipeline.config import PoolSettings

pytestmark = pytest.mark.launch

# A stalled first copy sleeps this long; the checks below finish well before it. Generous: on a loaded 2-core
# machine starting a hedge's worker and dispatching to it can take a second or more.
STALL = 10.0


def copy_of(directory: str, key: str, stall_s: float, sleep_s: float = 0.05, fail: bool = False) -> int:
    """One copy of an action: claims the next copy number of ``key`` (atomically, across worker processes, through
    O_CREAT|O_EXCL on ``key.n``, with its start time inside), sleeps ``stall_s`` if it is copy 0 and ``sleep_s``
    otherwise, marks ``key.n.done``, then raises if ``fail`` or returns n."""
    n = 0
    while True:
        try:
            fd = os.open(f"{directory}/{key}.{n}", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            break
        except FileExistsError:
            n += 1
    os.write(fd, repr(time.time()).encode())
    os.close(fd)
    time.sleep(stall_s if n == 0 else sleep_s)
    Path(f"{directory}/{key}.{n}.done").touch()
    if fail:
        raise RuntimeError(f"copy {n} failed")
    return n


def started(directory: Path, key: str, n: int) -> float:
    return float((directory / f"{key}.{n}").read_text())


class LiveWorkers:
    """The most ``ActionWorker`` actors Ray itself held alive at once while the block ran, sampled every few ms.

    The witness is Ray's actor table, not the pool's own count (that is the bookkeeping under test). It is read
    from the GCS directly: ``ray.util.state.list_actors`` goes through the dashboard's API server, which the
    ``local_ray`` fixture does not start, and at about 2 ms a read the GCS can be sampled densely enough to catch
    a worker spawned before another one was gone.
    """

    def __init__(self, interval_s: float = 0.005) -> None:
        self.interval_s = interval_s
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._before: set[str] = set()

    def alive(self) -> set[str]:
        return {actor_id for actor_id, info in ray._private.state.actors().items()
                if info["ActorClassName"] == "ActionWorker" and info["State"] == "ALIVE"}

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, len(self.alive() - self._before))
            time.sleep(self.interval_s)

    def __enter__(self) -> LiveWorkers:
        self._before = self.alive()  # an earlier test's pool: not this one's
        self._thread.start()
        return self

    def __exit__(self, *_) -> None:
        self._stop.set()
        self._thread.join()


def warm_pool(**settings) -> ActionPool:
    pool = ActionPool(PoolSettings(num_cpus=0, timeout_s=2 * STALL, idle_grace_s=30, **settings))
    pool.wait_ready()
    return pool


@pytest.mark.parametrize("hedge_after_s", [0.2, None])
def test_a_stalled_attempt_is_hedged_and_its_loser_killed(local_ray, tmp_path: Path, hedge_after_s) -> None:
    pool = warm_pool(min_workers=2, max_workers=2, hedge_after_s=hedge_after_s)
    begin, wall = time.monotonic(), time.time()
    outcome = pool.submit(Job(copy_of, (str(tmp_path), "a", STALL))).result(timeout=30)
    took = outcome.finished - begin
    assert outcome.status == "ok" and outcome.attempts == 1
    if hedge_after_s is None:  # no hedge: the action takes the whole stall, on its only copy
        assert took >= STALL and outcome.value == 0 and not outcome.hedged
        assert not (tmp_path / "a.1").exists()
    else:  # the duplicate copy (copy 1) started after hedge_after_s and won long before the stall ended
        assert took < STALL / 2 and outcome.value == 1 and outcome.hedged
        assert started(tmp_path, "a", 1) >= wall + hedge_after_s
        time.sleep(STALL + 0.5 - took)
        assert not (tmp_path / "a.0.done").exists()  # the stalled copy's worker was killed before it woke up
        assert pool.live_workers() == 2  # and replaced, back to min_workers
        assert pool.submit(Job(copy_of, (str(tmp_path), "b", 0.0))).result(timeout=30).status == "ok"
    pool.shutdown()


def test_a_raising_action_is_recorded_failed_once(local_ray, tmp_path: Path) -> None:
    pool = warm_pool(min_workers=2, max_workers=2, hedge_after_s=0.2, retries=2)
    # Copy 0 raises after 3 s; copy 1 (the hedge, from 0.2 s: nearly 3 s to get going even on a loaded machine)
    # would raise 4 s after it started: the first to raise decides, once.
    outcome = pool.submit(Job(copy_of, (str(tmp_path), "a", 3.0, 4.0, True))).result(timeout=30)
    assert outcome.status == "failed" and outcome.error == "RuntimeError: copy 0 failed"
    assert outcome.attempts == 1 and outcome.hedged  # raising is deterministic: no retry
    assert (tmp_path / "a.1").exists() and not (tmp_path / "a.2").exists()
    time.sleep(2.5)  # past the end of copy 1's 4 s, counted from its start after 0.2 s
    assert not (tmp_path / "a.1.done").exists()  # the losing copy was killed, it never got to raise
    # The dispatcher survived (a second result for the same future would have killed it) and serves on.
    assert pool._thread.is_alive()
    assert pool.submit(Job(copy_of, (str(tmp_path), "b", 0.0))).result(timeout=30).value == 0
    pool.shutdown()


def test_a_copy_that_times_out_records_nothing_while_another_runs(local_ray, tmp_path: Path) -> None:
    pool = ActionPool(PoolSettings(num_cpus=0, min_workers=2, max_workers=2, timeout_s=1.0, hedge_after_s=0.3))
    pool.wait_ready()
    # Copy 0 stalls past the 1 s timeout; copy 1 (the hedge, from 0.3 s) runs 0.9 s, so it is still running when
    # copy 0 times out (at 1 s) and returns after it (at ~1.2 s): its result is the outcome, with no retry.
    outcome = pool.submit(Job(copy_of, (str(tmp_path), "a", STALL, 0.9))).result(timeout=30)
    assert outcome.status == "ok" and outcome.value == 1 and outcome.hedged and outcome.attempts == 1
    assert not (tmp_path / "a.2").exists()
    pool.shutdown()


def test_hedges_never_exceed_max_workers(local_ray, tmp_path: Path) -> None:
    with LiveWorkers() as live:
        pool = warm_pool(min_workers=2, max_workers=2, hedge_after_s=0.2)
        begin = time.monotonic()
        a, b = pool.map([Job(copy_of, (str(tmp_path), "a", 1.0)), Job(copy_of, (str(tmp_path), "b", STALL))])
        pool.wait_ready()  # b's losing copy was killed and its worker replaced: the replacement is sampled alive
        time.sleep(0.1)
        pool.shutdown()
    # Both workers hold a stalled copy and the pool may not grow: neither is hedged while both run. a is done
    # after 1 s, unhedged; b, overdue since 0.2 s, is hedged on a's freed worker then, and the hedge wins.
    assert a.status == "ok" and a.value == 0 and not a.hedged and not (tmp_path / "a.1").exists()
    assert b.status == "ok" and b.value == 1 and b.hedged and b.finished - begin < STALL
    assert started(tmp_path, "b", 1) >= started(tmp_path, "a", 0) + 1.0
    assert live.peak == 2  # Ray never held more than max_workers of them (and the sampler saw them)


def test_the_pool_grows_for_hedges_up_to_max_workers(local_ray, tmp_path: Path) -> None:
    with LiveWorkers() as live:
        pool = warm_pool(min_workers=2, max_workers=3, hedge_after_s=0.2)
        begin = time.monotonic()
        outcomes = pool.map([Job(copy_of, (str(tmp_path), key, STALL)) for key in "ab"])
        pool.wait_ready()  # the losers' workers were killed and replaced: the replacements are sampled alive
        time.sleep(0.1)
        pool.shutdown()
    # Both warm workers hold a stalled copy; two hedges are due but only one worker may start: it hedges the
    # longest overdue, wins, and is then free to hedge the other.
    assert all(o.status == "ok" and o.hedged and o.value == 1 for o in outcomes)
    assert max(o.finished for o in outcomes) - begin < STALL
    assert live.peak == 3  # Ray really started the third worker, and never a fourth


def test_queued_actions_go_before_hedges(local_ray, tmp_path: Path) -> None:
    pool = warm_pool(min_workers=2, max_workers=2, hedge_after_s=0.1)
    # a (cheapest: first out of the queue) stalls on one worker; six 0.2 s actions queue for the other. a is
    # overdue after 0.1 s, but its hedge must wait until the last queued action has a worker and is done.
    jobs = [Job(copy_of, (str(tmp_path), "a", STALL), expected_cost=0.0)]
    jobs += [Job(copy_of, (str(tmp_path), f"q{i}", 0.2)) for i in range(6)]
    stalled, *quick = pool.map(jobs)
    assert all(o.status == "ok" and o.value == 0 for o in quick)
    assert stalled.hedged and stalled.value == 1
    assert started(tmp_path, "a", 1) >= max(started(tmp_path, f"q{i}", 0) for i in range(6)) + 0.2
    pool.shutdown()


def _cannot_unpickle() -> None:
    raise RuntimeError("this argument cannot be unpickled")


class Unpicklable:
    def __reduce__(self):
        return _cannot_unpickle, ()


def test_a_ray_error_fails_the_action_not_the_dispatcher(local_ray, tmp_path: Path) -> None:
    pool = warm_pool(min_workers=1, max_workers=1)
    outcome = pool.submit(Job(copy_of, (Unpicklable(), "a", 0.0))).result(timeout=30)
    assert outcome.status == "failed" and "cannot be unpickled" in outcome.error
    assert pool.submit(Job(copy_of, (str(tmp_path), "b", 0.0))).result(timeout=30).status == "ok"
    pool.shutdown()
