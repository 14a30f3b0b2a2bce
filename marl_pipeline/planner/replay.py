"""The simulation's decisions checked against a stored run's own: the orchestrator's functions the simulation
imports (the router, the staleness gate) fed the run's recorded times, their decisions compared with the recorded
ones. Where they agree, the simulation decides as the run did; what remains between a prediction and a
measurement is then the costs, not the decisions.
"""

from __future__ import annotations

from dataclasses import dataclass

from marl_pipeline.inference.router import EpisodeRoute, Router
from marl_pipeline.planner.costs import epoch_seconds
from marl_pipeline.run.pipeline_metrics import spans_from_store, version_timings
from marl_pipeline.run.queues import gate_open
from marl_pipeline.store import ExperienceStore


@dataclass(frozen=True)
class Agreement:
    """How many of a run's decisions of one kind the replay made as recorded, and the first that differ."""

    decisions: int
    equal: int
    differing: list[tuple]

    @property
    def share(self) -> float:
        return self.equal / self.decisions if self.decisions else 1.0


def replay_routing(store: ExperienceStore, run: str, replicas: dict[str, int],
                   max_outstanding: dict[str, int | None] | None = None, lanes: bool = True) -> Agreement:
    """Each stored turn's replica, chosen again by the agent's router over the recorded turns in the order they
    started and finished (a request is acquired when its turn started, released when it ended; an episode's home
    forgotten after its last turn), against the replica the row names (``engine``: ``<agent>/<replica>``).
    ``lanes``: the run's ``pipeline.rollout.lanes`` (False for runs stored before 6f52985, 2026-11-29).

    Valid for runs whose replicas did not change during a rollout (no weight sync while sampling: staleness 0, no
    replica restarted or rebalanced), where the router's draining never applied."""
    table = store.read_stage(run, "rollouts", columns=["step", "micro_batch", "episode", "turn", "agent", "engine",
                                                       "rollout_start", "rollout_end"])
    max_outstanding = max_outstanding or {}
    routers = {agent: Router(count, max_outstanding.get(agent)) for agent, count in replicas.items()}
    rows = table.to_pylist()
    starts, ends = epoch_seconds(table.column("rollout_start")), epoch_seconds(table.column("rollout_end"))
    last_turn: dict[tuple, int] = {}
    for row in rows:
        key = (row["step"], row["micro_batch"], row["episode"])
        last_turn[key] = max(last_turn.get(key, -1), row["turn"])
    # ends before starts at the same instant: a turn's end is stamped after its request was released
    events = sorted([(end, 0, index) for index, end in enumerate(ends)]
                    + [(start, 1, index) for index, start in enumerate(starts)])
    chosen: dict[int, int] = {}
    routes = {key: EpisodeRoute(key, lanes) for key in last_turn}  # an episode's turns run one after another
    for _, starting, index in events:
        row = rows[index]
        key = (row["step"], row["micro_batch"], row["episode"])
        router = routers[row["agent"]]
        if starting:
            chosen[index] = routes[key].acquire(router)
        elif index in chosen:
            routes[key].release(router, chosen[index])
            if row["turn"] == last_turn[key]:
                routes[key].end(routers.values())
    differing = [(rows[i]["step"], rows[i]["micro_batch"], rows[i]["episode"], rows[i]["turn"], rows[i]["engine"],
                  f"{rows[i]['agent']}/{chosen[i]}") for i in range(len(rows))
                 if rows[i]["engine"] != f"{rows[i]['agent']}/{chosen[i]}"]
    return Agreement(len(rows), len(rows) - len(differing), differing[:10])


def replay_gate(store: ExperienceStore, run: str, staleness: int | dict[str, int], tolerance_s: float = 0.25
                ) -> Agreement:
    """Each stored step's rollout release, decided again by the staleness gate over the times each agent's engines
    came to serve each version they loaded (its ``timing.json``: the publisher's start, its optimizer step and its
    sync; a version not loaded, under ``sync_every``, is never served) and the
    end of the step before's rollout, against the recorded release (the step's first rollout partition's
    ``stage_enqueued``), equal within ``tolerance_s`` (the publisher's own bookkeeping between the two stamps)."""
    released: dict[int, float] = {}
    ended: dict[int, float] = {}
    timings = version_timings(store, run)
    for span in spans_from_store(store, run, timings):
        if span.stage == "rollouts":
            released[span.step] = min(released.get(span.step, span.enqueued), span.enqueued)
            ended[span.step] = max(ended.get(span.step, span.ended), span.ended)
    agents = set(store.read_stage(run, "policy_updates", columns=["agent"]).column("agent").to_pylist())
    served: dict[str, dict[int, float]] = {agent: {0: float("-inf")} for agent in agents}  # served 0 at the start
    recorded: dict[str, set[int]] = {agent: {0} for agent in agents}
    for (agent, version), record in timings.items():
        recorded[agent].add(version)
        if record.get("served", True):  # else its engines kept an older version (agents.<a>.sync_every)
            served[agent][version] = record["started"] + record.get("apply_seconds", 0.0) + record["sync_seconds"]
    opened = _gate_times(served, recorded, sorted(released), staleness)
    differing, equal = [], 0
    for step in sorted(released)[1:]:
        if opened.get(step) is None:
            continue  # open from the launch's start, or waiting on a version that went uncommitted
        replayed = max(opened[step], ended.get(step - 1, 0.0))  # the rollout thread samples one step at a time
        if abs(replayed - released[step]) <= tolerance_s:
            equal += 1
        else:
            differing.append((step, released[step], replayed))
    return Agreement(equal + len(differing), equal, differing[:10])


def _gate_times(served: dict[str, dict[int, float]], recorded: dict[str, set[int]], steps: list[int],
                staleness: int | dict[str, int]) -> dict[int, float | None]:
    """When the gate opened for each step: the first recorded serve at which ``gate_open`` holds (None: open from
    the start). Steps whose versions went unrecorded (pruned by retention: keep every version to replay them all)
    are left out; ``recorded``: each agent's versions with a record, served or not."""
    def versions_at(time: float) -> dict[str, int]:
        return {agent: max(v for v, t in versions.items() if t <= time) for agent, versions in served.items()}

    opened: dict[int, float | None] = {}
    moments = sorted({t for versions in served.values() for t in versions.values()})
    bounds = staleness if isinstance(staleness, dict) else dict.fromkeys(served, staleness)
    for step in steps:
        if gate_open(versions_at(moments[0]), step, staleness):
            opened[step] = None
            continue
        if all(step - bounds[agent] in recorded[agent] and max(versions) >= step - bounds[agent]
               for agent, versions in served.items()):
            opened[step] = next(t for t in moments if gate_open(versions_at(t), step, staleness))
    return opened
