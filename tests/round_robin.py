"""The routing baseline sticky routing is measured against (bench/pipeline/rollout.py): every request to the next live
replica in turn, whatever its episode, so an episode's later turns rarely find their prefix in the replica's cache."""

from __future__ import annotations

from collections.abc import Hashable

from marl_pipeline.inference.router import Router


class RoundRobinRouter(Router):
    def __init__(self, replicas: int, max_outstanding: int | None = None) -> None:
        super().__init__(replicas, max_outstanding)
        self._next = 0

    def _choose(self, episode: Hashable, live: list[int], lane: tuple[int, int] | None = None) -> int | None:
        chosen = live[self._next % len(live)]
        self._next += 1
        return chosen
