"""One engine replica in the planner's simulation (planner/simulate.py): continuous batching on its spec's threads, a
step's finished requests returned together after their own work, a weight sync that drains it; and the busy time of an
actor.
"""

from __future__ import annotations

import simpy

from marl_pipeline.cluster.specs import ActorSpec
from marl_pipeline.planner.costs import EngineCosts, Turn
from marl_pipeline.planner.shared_cores import SharedCores


class Busy:
    """Time during which an actor or stage had work in progress."""

    def __init__(self, env: simpy.Environment) -> None:
        self.env, self.active, self.since, self.total = env, 0, 0.0, 0.0

    def start(self) -> None:
        if self.active == 0:
            self.since = self.env.now
        self.active += 1

    def stop(self) -> None:
        self.active -= 1
        if self.active == 0:
            self.total += self.env.now - self.since


class EngineReplica:
    """One engine replica: continuous batching, one step at a time on its spec's threads, then the step's finished
    requests returned together once their own work is done; a weight sync waits for the step in progress and pauses
    the next ones while it loads."""

    def __init__(self, env: simpy.Environment, spec: ActorSpec, costs: EngineCosts, cores: tuple[SharedCores, bool],
                 busy: Busy, interpreter: simpy.Resource) -> None:
        """``cores``: where it computes, and whether that is a device (a job there runs on one thread); ``busy``:
        told when it computes; ``interpreter``: the process's, which a hybrid agent's trainer shares."""
        self.env, self.spec, self.costs = env, spec, costs
        self.cores, device = cores
        self.threads = 1 if device else spec.threads
        self.interpreter = interpreter
        self.version = 0
        self.waiting: list[list] = []  # [prompt tokens, tokens left, done event, its own work]
        self.running: list[list] = []
        self.syncs: list[tuple[float, int, simpy.Event]] = []
        self.before_sync = 0  # requests that came before the pending sync: taken in by the next step
        self.wake = env.event()
        self.busy = busy
        env.process(self._loop())

    def generate(self, turn: Turn, index: int) -> simpy.Event:
        self.waiting.append([turn.prompt_tokens, max(turn.response_tokens, 1), done := self.env.event(),
                             self.costs.request(index)])
        self._poke()
        return done

    def sync(self, seconds: float, version: int) -> simpy.Event:
        done = self.env.event()
        if not self.syncs:
            self.before_sync = len(self.waiting)
        self.syncs.append((seconds, version, done))
        self._poke()
        return done

    def _poke(self) -> None:
        if not self.wake.triggered:
            self.wake.succeed()

    def _loop(self):
        env = self.env
        while True:
            if self.syncs and not self.running and not self.before_sync:  # drained: the reload, on this engine's
                seconds, version, done = self.syncs.pop(0)  # cores (vLLM's CPU backend re-packs the weights)
                self.busy.start()
                yield self.cores.compute(seconds, 1, "engines")
                self.busy.stop()
                self.version = version
                done.succeed()
                continue
            # As the engine's loop: a pending reload holds the requests that came after it, while those in flight
            # (and taken in before it) finish on the old version.
            taken = self.before_sync if self.syncs else len(self.waiting)
            admitted, self.waiting, self.before_sync = self.waiting[:taken], self.waiting[taken:], 0
            if not admitted and not self.running:
                self.wake = env.event()
                yield self.wake
                continue
            self.running += admitted
            work = (self.costs.step + self.costs.per_sequence * len(self.running)
                    + self.costs.per_prompt_token * sum(request[0] for request in admitted))
            self.busy.start()
            with self.interpreter.request() as held:  # a hybrid agent's trainer shares this process's
                yield held
                yield self.cores.compute(work, self.threads, "engines")
                for request in self.running:
                    request[1] -= 1
                finished = [r for r in self.running if r[1] <= 0]
                self.running = [r for r in self.running if r[1] > 0]
                # Returned together after their own work on one thread, as the stream yields a step's results in
                # one chunk (docs/ARCHITECTURE.md, the planner); a GPU's costs have no such work.
                if (own := sum(request[3] for request in finished)) > 0:
                    yield self.cores.compute(own, 1, "engines")
                for request in finished:
                    request[2].succeed(self.version)
            self.busy.stop()
