"""One service's quota, kept by one asyncio scheduler: calls wait in a queue ordered by their expected cost (as the
action pool orders actions: short calls never wait behind long ones) and are granted, head first, when

- fewer than ``concurrency`` calls are in flight,
- fewer than ``requests_per_second`` calls were granted in the last (1 + margin) seconds, and the last one at
  least (1 + margin) / ``requests_per_second`` seconds ago (paced: calls granted in a burst reach the service
  after more varied delays than calls granted one by one, and the margin must cover that spread),
- the tokens granted in the last (1 + margin) minutes leave room for the call's estimate (``tokens_per_minute``),
- no 429's ``Retry-After`` is holding the service back.

Paced sliding windows of the grants themselves, not token buckets: a bucket full at the start of a second lets
twice the rate through in one second, which a service counting fixed windows answers with 429s. Hand-written
because the rate limiters for asyncio (aiolimiter, limits) keep one process's rate; this one is the whole run's,
fed by a Ray actor (services/scheduler.py), with the queue's order and each step's figures.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections import deque
from dataclasses import dataclass, field

from marl_pipeline.config import ServiceConfig
from marl_pipeline.external import CallRecord


@dataclass(order=True)
class _Waiting:
    cost: float
    sequence: int
    tokens: int = field(compare=False)
    queued: float = field(compare=False)
    granted: asyncio.Future = field(compare=False)


@dataclass
class _Window:
    """What the scheduler saw since the figures were last taken."""

    started: float
    waits: list[float] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    calls: int = 0
    tokens: int = 0
    throttled: int = 0
    retries: int = 0
    failures: int = 0
    granted: int = 0
    backlogged_s: float = 0.0
    """Seconds during which some call waited for the quota (demand above it)."""
    backlogged_grants: int = 0
    """Calls granted after waiting, or while others waited."""


class QuotaScheduler:
    """A service's queue and quota; every method runs in one event loop (the scheduler actor's)."""

    def __init__(self, settings: ServiceConfig, clock=time.monotonic) -> None:
        self.settings, self.clock = settings, clock
        self._queue: list[_Waiting] = []
        self._sequence = itertools.count()
        self._grants: deque[float] = deque()  # grant times within the request window
        self._spent: deque[list] = deque()  # [grant time, tokens] within the token window
        self._in_flight: dict[int, list] = {}  # permit id -> [grant time, tokens estimated]
        self._ids = itertools.count(1)
        self._held_until = 0.0
        self._wake: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None
        self._window = _Window(clock())
        self._backlog_since: float | None = None

    @property
    def _lease(self) -> float:
        return self.settings.timeout_s + 5.0

    @property
    def request_window(self) -> float:
        return 1.0 + self.settings.margin

    @property
    def token_window(self) -> float:
        return 60.0 * (1.0 + self.settings.margin)

    async def acquire(self, cost: float, tokens: int) -> tuple[int, float]:
        """Wait for a grant; -> (permit id, seconds waited)."""
        if self._loop_task is None:
            self._wake = asyncio.Event()
            self._loop_task = asyncio.get_running_loop().create_task(self._grant_loop())
        granted = asyncio.get_running_loop().create_future()
        heapq.heappush(self._queue, _Waiting(float(cost), next(self._sequence), int(tokens), self.clock(), granted))
        self._wake.set()
        return await granted

    def release(self, permit: int, record: CallRecord, retry_after_s: float | None) -> None:
        """A call's try is over: count it, correct its tokens, and hold the service back after a 429."""
        now, window = self.clock(), self._window
        entry = self._in_flight.pop(permit, None)
        if entry is not None and entry[1] != record.tokens and self.settings.tokens_per_minute is not None:
            for spent in self._spent:  # the grant's estimate, replaced by the answer's usage
                if spent[0] == entry[0] and spent[1] == entry[1]:
                    spent[1] = record.tokens
                    break
        window.calls += 1
        window.tokens += record.tokens
        window.latencies.append(record.latency_s)
        window.retries += record.retry
        window.throttled += record.status_code == 429
        window.failures += record.outcome == "failed"
        if record.status_code == 429:
            hold = retry_after_s if retry_after_s is not None else self.settings.backoff_s
            self._held_until = max(self._held_until, now + hold)
        if self._wake is not None:
            self._wake.set()

    def take_window(self) -> dict:
        """The figures since the last call (a step's), and a new window."""
        now, window = self.clock(), self._window
        if self._backlog_since is not None:
            window.backlogged_s += now - self._backlog_since
            self._backlog_since = now
        self._window = _Window(now)
        seconds = max(now - window.started, 1e-9)
        rps, tpm = self.settings.requests_per_second, self.settings.tokens_per_minute
        return {
            "seconds": seconds, "calls": window.calls, "granted": window.granted, "tokens": window.tokens,
            "throttled": window.throttled, "retries": window.retries, "failures": window.failures,
            "queue_wait_p50": _quantile(window.waits, 0.5), "queue_wait_p99": _quantile(window.waits, 0.99),
            "latency_p50": _quantile(window.latencies, 0.5), "latency_p99": _quantile(window.latencies, 0.99),
            "request_quota_use": window.granted / (rps * seconds) if rps else None,
            "token_quota_use": window.tokens / (tpm * seconds / 60.0) if tpm else None,
            "backlogged_share": window.backlogged_s / seconds,
            "backlogged_request_quota_use": (window.backlogged_grants / (rps * window.backlogged_s)
                                             if rps and window.backlogged_s > 0 else None),
        }

    def _ready_at(self, head: _Waiting, now: float) -> float:
        """When the head of the queue may be granted (``now`` when it may now; while the calls in flight are at the
        limit, when the oldest one's lease ends, unless a release wakes the loop first)."""
        if len(self._in_flight) >= self.settings.concurrency:
            return min(granted for granted, _ in self._in_flight.values()) + self._lease
        at = max(now, self._held_until)
        while self._grants and self._grants[0] <= now - self.request_window:
            self._grants.popleft()
        rps = self.settings.requests_per_second
        if rps is not None and self._grants:  # paced: a burst's calls reach the service by more varied delays
            at = max(at, self._grants[-1] + self.request_window / rps)
        if rps is not None and len(self._grants) >= max(1, int(rps * self.request_window)):
            limit = max(1, int(rps * self.request_window))
            at = max(at, self._grants[-limit] + self.request_window)
        tpm = self.settings.tokens_per_minute
        if tpm is not None:
            while self._spent and self._spent[0][0] <= now - self.token_window:
                self._spent.popleft()
            budget = tpm * (1.0 + self.settings.margin) - min(head.tokens, tpm)
            used = sum(tokens for _, tokens in self._spent)
            for when, tokens in self._spent:  # the oldest grants leave the window first
                if used <= budget:
                    break
                used -= tokens
                at = max(at, when + self.token_window)
        return at

    async def _grant_loop(self) -> None:
        while True:
            self._wake.clear()
            now = self.clock()
            while self._queue and self._queue[0].granted.done():  # a caller that gave up
                heapq.heappop(self._queue)
            # A try ends within its timeout: a permit held longer belongs to a caller cancelled after its grant
            # (its release never comes), and would hold a place among the calls in flight for ever.
            for permit in [p for p, (granted, _) in self._in_flight.items() if granted < now - self._lease]:
                del self._in_flight[permit]
            self._track_backlog(now)
            if not self._queue:
                await self._wake.wait()
                continue
            head = self._queue[0]
            at = self._ready_at(head, now)
            if at <= now:
                heapq.heappop(self._queue)
                self._window.backlogged_grants += len(self._queue) > 0 or now > head.queued
                permit = next(self._ids)
                self._in_flight[permit] = [now, head.tokens]
                self._grants.append(now)
                if self.settings.tokens_per_minute is not None:
                    self._spent.append([now, head.tokens])
                self._window.granted += 1
                self._window.waits.append(now - head.queued)
                head.granted.set_result((permit, now - head.queued))
                continue
            try:
                await asyncio.wait_for(self._wake.wait(), at - now)
            except TimeoutError:
                pass

    def _track_backlog(self, now: float) -> None:
        if self._queue and self._backlog_since is None:
            self._backlog_since = now
        elif not self._queue and self._backlog_since is not None:
            self._window.backlogged_s += now - self._backlog_since
            self._backlog_since = None


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
