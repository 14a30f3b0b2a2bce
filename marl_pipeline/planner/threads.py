"""An actor's threads: those the calibration run gave it (``AgentThreads``), the share of the node's cores its trainer
calls had (``core_shares``), and what more threads buy a trainer (``ThreadScaling``), measured by
``marl profile threads`` rather than taken as linear: work of W seconds on one thread takes
``W / speedup(T)`` on T free cores and keeps all T busy meanwhile (the threads spin while the ops divide badly). On the
planner bench's tiny model a second thread buys 1.5x, not 2x (BENCHMARKS.md, planner-error).

The format (JSON)::

    {"cpu": "AMD EPYC ...", "command": "...", "trainer": {"1": 1.0, "2": 1.49}, "crowding": 0.1}

Thread counts beyond the profile's largest keep its efficiency (speed-up per thread); without a profile the speed-up
is the thread count (the simulation's linear assumption, stated with the prediction). ``crowding`` (optional, 0 when
absent): how much work a node's threads lose while more of them run than it has cores (planner/shared_cores.py), a
host's figure that marl profile crowding fits from launches of several layouts.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from marl_pipeline.planner.shared_cores import crowded


@dataclass(frozen=True)
class ThreadScaling:
    """A trainer's speed-up on 1, 2, ... threads over one (``trainer[T - 1]``); empty: linear."""

    trainer: tuple[float, ...] = ()
    source: str = ""
    crowding: float = 0.0
    """Beyond a node's cores, a core-second held does ``(cores / threads) ** crowding`` of its work."""

    def speedup(self, threads: int) -> float:
        """How many times as fast a trainer's work goes on ``threads`` free threads as on one."""
        threads = max(threads, 1)
        if not self.trainer:
            return float(threads)
        if threads <= len(self.trainer):
            return self.trainer[threads - 1]
        return self.trainer[-1] * threads / len(self.trainer)

    def describe(self) -> str:
        """The assumption a prediction with these figures makes."""
        crowded = (f"; while a node runs more threads than cores, a core-second does (cores / threads) ** "
                   f"{self.crowding:g} of its work" if self.crowding else
                   "; threads beyond a node's cores share them without loss")
        if not self.trainer:
            return ("an actor's threads divide its work evenly (W core-seconds on T threads take W / T seconds on "
                    "free cores); a small model's ops divide worse: give a measured thread profile" + crowded)
        measured = ", ".join(f"{threads + 1}: {speedup:.2f}x" for threads, speedup in enumerate(self.trainer))
        return (f"a trainer on T threads goes as fast as the thread profile {self.source} measured ({measured}; "
                f"beyond, the last's speed-up per thread), keeping its T threads busy; an engine's threads divide its "
                f"work evenly" + crowded)

    def efficiency(self, share: float) -> float:
        """The work a core-second does when the node's threads get ``share`` of a core each (at most 1)."""
        return crowded(share, self.crowding)


def thread_profile(path: str | Path) -> ThreadScaling:
    """The trainer speed-ups a ``marl profile threads`` profile measured, and its crowding exponent.

    Raises:
        ValueError: the file is not such a profile, its speed-ups do not start at one thread, skip a count, or are
            not positive (naming which), or its crowding is not a number from 0 to 2.
    """
    path = Path(path)
    try:
        data = json.loads(path.read_text())
        entries = data["trainer"].items()
        measured = {int(threads): float(speedup) for threads, speedup in entries}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise ValueError(f"thread profile {path}: expected JSON with a \"trainer\" object of thread count -> speed-up "
                         f"over one thread, as marl profile threads writes ({type(error).__name__}: "
                         f"{error})") from None
    counts = sorted(measured)
    if not counts or counts != list(range(1, len(counts) + 1)):
        raise ValueError(f"thread profile {path}: trainer speed-ups for threads {counts}; expected 1, 2, ... with "
                         f"none skipped")
    if bad := [threads for threads in counts if measured[threads] <= 0]:
        raise ValueError(f"thread profile {path}: speed-ups at threads {bad} are not positive")
    crowding = data.get("crowding", 0.0)
    if isinstance(crowding, bool) or not isinstance(crowding, (int, float)) or not 0 <= crowding <= 2:
        raise ValueError(f"thread profile {path}: crowding {crowding!r} is not a number from 0 to 2 (the exponent "
                         f"marl profile crowding fits; 0: no loss beyond the cores)")
    return ThreadScaling(tuple(measured[threads] / measured[1] for threads in counts), str(path), float(crowding))


@dataclass(frozen=True)
class AgentThreads:
    """What the calibration run gave an agent: its engine's and trainer's threads (its specs'), its replicas, the
    trainer actor its calls ran on (a swapped worker serves several agents' calls one at a time), and whether that
    trainer computed on the node's cores (not a GPU)."""

    engine_threads: int
    trainer_threads: int
    replicas: int = 1
    trainer: str = ""
    trainer_on_cores: bool = False


def worker_of(agent_threads: dict[str, AgentThreads], agent: str) -> str:
    """The trainer actor an agent's calls ran on (a swapped worker is shared; unknown: the agent's own)."""
    own = agent_threads.get(agent)
    return own.trainer if own is not None and own.trainer else agent


def core_shares(updates, agent_threads: dict[str, AgentThreads], cores: float | None,
                scaling: ThreadScaling | None = None) -> dict[tuple, float]:
    """Per (step, micro-batch): the share of its threads each trainer call on the node's cores had, with the other
    trainers' calls of the micro-batch at once (those of one actor run one after another: one thread set). The train
    stage issues a micro-batch's calls to every agent's trainer at once, so trainers on a node's cores that ask for
    more threads than it has share them (as the simulation shares them, planner/shared_cores.py, a crowded core-second
    doing ``scaling``'s share of its work). The driver is not counted:
    the simulation charges its CPU beside the turns, so a call fitted as if it shared the cores with the driver came
    back that much faster in the simulation of its own run."""
    if cores is None:
        return {}
    workers: dict[tuple, dict[str, int]] = defaultdict(dict)
    for step, mb, agent in zip(updates.column("step").to_pylist(), updates.column("micro_batch").to_pylist(),
                               updates.column("agent").to_pylist()):
        own = agent_threads.get(agent)
        if own is not None and own.trainer_on_cores:
            workers[(step, mb)][worker_of(agent_threads, agent)] = own.trainer_threads
    efficiency = (scaling or ThreadScaling()).efficiency  # the crowding the simulation charges, counted here alike
    return {key: (share := min(1.0, cores / sum(threads.values()))) * efficiency(share)
            for key, threads in workers.items()}
