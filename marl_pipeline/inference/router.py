"""Which of an agent's engine replicas serves a request: pure bookkeeping, no Ray, no engine.

- *Sticky*: an episode's later turns go to the replica that served its earlier ones. Its prompt extends the
  earlier turn's prompt and response, whose KV blocks sit in that replica's prefix cache; another replica would
  compute the whole prefix again.
- *Least outstanding*: a new episode (or one whose replica is down) goes to the replica with the fewest requests
  in flight, unless that replica is saturated (``max_outstanding``); when every replica is saturated it waits.
- *Lanes*: a new episode whose previous turn ran on replica ``i`` of another agent with as many replicas goes to
  replica ``i`` too, unless it is draining, down or saturated. One engine step's results come back together and the
  episodes' next turns go out in one call; spread over the next agent's replicas, each replica would take in the
  pieces of two upstream replicas apart (they drift out of phase on crowded cores) and step more, smaller batches.
- *Down / draining*: a replica that died (or is restarting) takes nothing; one loading new weights takes no new
  episode (its sticky episodes still come: the engine holds them until the reload is done).

One router serves an agent for the whole run, from the rollout thread and a replica's restart thread at once,
so its state is behind a lock.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Iterable, Iterator


class NoReplica(RuntimeError):
    """Every replica is down: nothing can serve the request until one is restarted."""


class Router:
    """Routes requests of episodes (any hashable key) to replicas ``0 .. replicas - 1``."""

    def __init__(self, replicas: int, max_outstanding: int | None = None) -> None:
        if not isinstance(replicas, int) or replicas < 1:
            raise ValueError(f"replicas must be an int >= 1, got {replicas!r}")
        if max_outstanding is not None and max_outstanding < 1:
            raise ValueError(f"max_outstanding must be >= 1 or None (no limit), got {max_outstanding!r}")
        self.replicas, self.max_outstanding = replicas, max_outstanding
        self._lock = threading.Lock()
        self._outstanding = [0] * replicas
        self._home: dict[Hashable, int] = {}
        self._down: set[int] = set()
        self._draining: set[int] = set()

    def acquire(self, episode: Hashable, lane: tuple[int, int] | None = None) -> int | None:
        """The replica for ``episode``'s next request, counted outstanding until :meth:`release`; None when every
        live replica is saturated (try again once a request finishes). ``lane``: ``(replicas, replica)`` of the
        episode's previous turn at another agent.

        Raises:
            NoReplica: every replica is down.
        """
        with self._lock:
            live = [i for i in range(self.replicas) if i not in self._down]
            if not live:
                raise NoReplica(f"all {self.replicas} replicas are down")
            chosen = self._choose(episode, live, lane)
            if chosen is not None:
                self._outstanding[chosen] += 1
            return chosen

    def _choose(self, episode: Hashable, live: list[int], lane: tuple[int, int] | None = None) -> int | None:
        """Sticky, else its lane, else least outstanding (under the lock); a subclass may route otherwise (bench's
        round robin)."""
        if (home := self._home.get(episode)) is not None and home not in self._down:
            return home  # its earlier turns' blocks are in this replica's prefix cache
        open_ = [i for i in live if i not in self._draining] or live  # all draining: they hold, not refuse
        if lane is not None and lane[0] == self.replicas and lane[1] in open_ and not self._saturated(lane[1]):
            chosen = lane[1]
        else:
            chosen = min(open_, key=lambda i: (self._outstanding[i], i))
            if self._saturated(chosen):
                return None
        self._home[episode] = chosen
        return chosen

    def lane(self, replica: int) -> tuple[int, int]:
        """The lane :meth:`acquire` takes for an episode's next agent after a turn this router put on ``replica``."""
        return self.replicas, replica

    def _saturated(self, replica: int) -> bool:
        return self.max_outstanding is not None and self._outstanding[replica] >= self.max_outstanding

    def release(self, replica: int) -> None:
        """A request acquired on ``replica`` finished (or failed)."""
        with self._lock:
            if self._outstanding[replica] <= 0:
                raise ValueError(f"replica {replica} has no outstanding request to release")
            self._outstanding[replica] -= 1

    def forget(self, episode: Hashable) -> None:
        """The episode is over: drop its sticky entry."""
        with self._lock:
            self._home.pop(episode, None)

    def mark_down(self, replica: int) -> None:
        """The replica died: route nothing to it; its episodes move on their next request."""
        with self._lock:
            self._down.add(replica)

    def mark_up(self, replica: int) -> None:
        with self._lock:
            self._down.discard(replica)

    def set_draining(self, replica: int, draining: bool) -> None:
        """While ``replica`` reloads weights, new episodes go elsewhere (when any other replica is live)."""
        with self._lock:
            (self._draining.add if draining else self._draining.discard)(replica)

    def outstanding(self) -> list[int]:
        with self._lock:
            return list(self._outstanding)

    def is_down(self, replica: int) -> bool:
        with self._lock:
            return replica in self._down


class EpisodeRoute:
    """One episode's way through the agents' routers, the one rule of the rollout (stages/trajectories.py) and the
    planner's simulation: each turn acquires a replica of its agent, by the episode's lane from its previous turn
    where ``lanes`` is on; a turn served releases it and leaves its lane to the next; a failed one releases it and
    keeps the lane it had; the episode's end forgets it at every router."""

    def __init__(self, episode: Hashable, lanes: bool) -> None:
        self.episode, self.lanes = episode, lanes
        self.lane: tuple[int, int] | None = None

    def acquire(self, router: Router) -> int | None:
        """:meth:`Router.acquire` for this episode's next turn (None: every live replica is saturated)."""
        return router.acquire(self.episode, self.lane)

    def release(self, router: Router, replica: int, served: bool = True) -> None:
        router.release(replica)
        if served:
            self.lane = router.lane(replica) if self.lanes else None

    def end(self, routers: Iterable[Router]) -> None:
        for router in routers:
            router.forget(self.episode)


def rolling_sync(router: Router, replicas: Iterable[int]) -> Iterator[int]:
    """The order a new version reaches an agent's replicas, the one rule of the replica set (inference/replicas.py)
    and the planner's simulation: one at a time, in order, each draining while it loads so that the others serve;
    a replica down is skipped (its restart loads the version)."""
    for replica in replicas:
        if router.is_down(replica):
            continue
        router.set_draining(replica, True)
        try:
            yield replica
        finally:
            router.set_draining(replica, False)


def split_replicas(demand: dict[str, float], total: int) -> dict[str, int]:
    """Across agents (FlexMARL's inter-agent level): ``total`` replicas split in proportion to each agent's token
    demand, at least one each; largest remainders get the replicas that rounding leaves, ties to the earlier agent.
    No demand at all splits evenly."""
    if not demand:
        raise ValueError("split_replicas needs at least one agent")
    if total < len(demand):
        raise ValueError(f"{total} replicas cannot give each of {len(demand)} agents one")
    if any(d < 0 for d in demand.values()):
        raise ValueError(f"token demand must be >= 0, got {demand}")
    agents, whole = list(demand), sum(demand.values())
    quota = {a: total * (demand[a] / whole if whole > 0 else 1 / len(agents)) for a in agents}
    split = {a: max(1, int(quota[a])) for a in agents}
    while sum(split.values()) > total:  # the minimum of one pushed it over: take from the most over-served
        over = max((a for a in agents if split[a] > 1), key=lambda a: (split[a] - quota[a], -agents.index(a)))
        split[over] -= 1
    while sum(split.values()) < total:
        under = max(agents, key=lambda a: (quota[a] - split[a], -agents.index(a)))
        split[under] += 1
    return split
