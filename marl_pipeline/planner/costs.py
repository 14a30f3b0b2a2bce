"""What the simulation charges for each piece of work, fitted from a stored run's own timestamps (``calibrate``),
and the workload it replays: the run's episodes, each a sequence of turns with their token counts.

Costs are in core-seconds (seconds on one thread with the core to itself), so a layout with other threads, or
more actors sharing a node's cores, is charged by the same figures (planner/shared_cores.py). The calibration multiplies
the stored seconds by the speed-up of the threads the run's specs gave each actor (a trainer's from a measured
thread profile where given, planner/threads.py; else the thread count), and a trainer call's by the share of the
node's cores it had beside the micro-batch's other calls; what it cannot see (threads moved during the run by the
split of the cores, engines sampling beside each other) is an assumption, stated with the prediction.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field, fields, replace
from itertools import pairwise

import numpy as np
import pyarrow.compute as pc

from marl_pipeline.planner.cpu import driver_rates, nonnegative_fit
from marl_pipeline.planner.threads import AgentThreads, ThreadScaling, core_shares, worker_of
from marl_pipeline.run.pipeline_metrics import Span, spans_from_store, version_timings
from marl_pipeline.store import ExperienceStore


@dataclass(frozen=True)
class EngineCosts:
    """One engine step (continuous batching): ``step + per_sequence x decoding sequences + per_prompt_token x
    prompt tokens admitted`` core-seconds; each decoding sequence gains one token a step. ``per_request``: a
    request's own work in the engine's process beyond the steps (taken in, its output made and returned), which the
    simulation does as the request's result is returned."""

    step: float
    per_sequence: float
    per_prompt_token: float
    per_request: float = 0.0
    per_request_by_turn: tuple[float, ...] = ()
    """``per_request`` by the turn's place in its episode, where the calibration run had it: a micro-batch's first
    turns go out together, later ones one by one as their episodes' replies come (one call each: dearer)."""

    def request(self, turn: int) -> float:
        return self.per_request_by_turn[turn] if turn < len(self.per_request_by_turn) else self.per_request


@dataclass(frozen=True)
class TrainerCosts:
    """One trainer call on a micro-batch: ``call + per_token x tokens`` core-seconds. A step's end: the optimizer
    step (``apply`` seconds), then the weights synced into each engine replica in turn (``sync_per_replica``
    core-seconds each, on the engine's cores) while the trainer saves the version, then the commit (``commit``
    seconds from the sync's end, the save included); the trainer takes no other call until its save is done."""

    call: float
    per_token: float
    apply: float
    sync_per_replica: float
    commit: float


@dataclass(frozen=True)
class Turn:
    agent: str
    prompt_tokens: int
    response_tokens: int
    observe_seconds: float = 0.0
    """The environment's reply to it (``observe``), which the episode waits for before its next turn."""


@dataclass(frozen=True)
class Costs:
    """Per agent engine and trainer costs, and the stages around them (seconds a micro-batch, on the driver)."""

    engines: dict[str, EngineCosts]
    trainers: dict[str, TrainerCosts]
    environment: float
    reward: float
    rollout_overhead: float
    """A rollout micro-batch's seconds beyond its turns (prompts rendered, the table built and committed)."""
    train_overhead: float
    """A training micro-batch's seconds beyond its trainers' calls (its inputs read, its rows committed)."""
    handoff: float = 0.0
    """Seconds from a micro-batch's stage ending to its next stage starting, and from a step's last training to its
    publisher starting: the table committed, the next thread woken (on the driver, off every core's charge)."""
    episodes: list[list[Turn]] = field(default_factory=list)
    """The workload: the calibration run's episodes, each its turns in order, drawn from for each simulated one."""
    source: str = ""
    driver_per_turn: float = 0.0
    """The driver process's own CPU (its rollout, stage and commit threads, Ray's calls from it) per turn, in
    core-seconds, beyond ``driver_per_message`` (0: a run stored before the driver's CPU was recorded)."""
    driver_per_message: float = 0.0
    """The driver's CPU per rollout message (a streaming call to a replica, a chunk of results back), beyond the turns'
    (0: a run stored before they were counted, 2026-11-29)."""
    messages_per_turn: float = 0.0
    """The calibration run's rollout messages per turn and per replica of its agents: two replicas split each wave
    into two calls and each step's results into two chunks, so a turn is charged ``driver_per_message x
    messages_per_turn x`` its agent's replicas (planner/cpu.py)."""
    threads: ThreadScaling = field(default_factory=ThreadScaling)
    """What a trainer's threads buy, which turned its stored seconds into core-seconds and the simulation applies."""


def epoch_seconds(column) -> np.ndarray:
    """A timestamp column (microseconds, UTC) as seconds since the epoch."""
    return pc.cast(column, "int64").to_numpy(zero_copy_only=False) / 1e6


def calibrate(store: ExperienceStore, run: str, agent_threads: dict[str, AgentThreads], cores: float | None = None,
              threads: ThreadScaling | None = None) -> Costs:
    """Fit the costs from run ``run``'s stored partitions and policy versions; ``agent_threads``: each agent's threads
    and replicas in that run, which turn stored seconds into core-seconds and a sync into a sync per replica; ``cores``:
    the node's cores the run's trainers shared (None: as many as they asked for); ``threads``: what a trainer's
    threads buy (None: linear).

    Raises:
        ValueError: the run has no committed rollouts or policy updates to fit from.
    """
    rollouts = store.read_stage(run, "rollouts", columns=[
        "step", "micro_batch", "episode", "turn", "agent", "prompt_ids", "response_ids", "rollout_start",
        "rollout_end", "engine_seconds", "observe_seconds", "stage_started", "stage_ended"])
    updates = store.read_stage(run, "policy_updates", columns=["step", "micro_batch", "agent", "tokens",
                                                                "compute_seconds", "stage_started", "stage_ended"])
    if rollouts.num_rows == 0 or updates.num_rows == 0:
        raise ValueError(f"run {run!r} in {store.config.uri} has no committed rollouts and policy updates to fit "
                         f"costs from: run a launch first")
    agents = sorted(set(rollouts.column("agent").to_pylist()))
    timings = version_timings(store, run)
    spans = spans_from_store(store, run, timings)
    busy = {stage: [(span.started, span.ended) for span in spans if span.stage == stage]
            for stage in ("rollouts", "policy_updates")}
    threads = threads or ThreadScaling()
    computed, shares = _computed(rollouts), core_shares(updates, agent_threads, cores, threads)
    return Costs(
        engines={agent: _engine_costs(rollouts, agent, agent_threads[agent].engine_threads, busy["policy_updates"])
                 for agent in agents},
        trainers={agent: _trainer_costs(updates, agent, agent_threads[agent], computed, busy["rollouts"],
                                        [record for (owner, _), record in timings.items() if owner == agent], shares,
                                        threads.speedup(agent_threads[agent].trainer_threads))
                  for agent in agents},
        environment=_median_span(spans, "environment_results"),
        reward=_median_span(spans, "rewards"),
        rollout_overhead=_rollout_overhead(rollouts),
        train_overhead=_train_overhead(updates, agent_threads),
        handoff=_handoff(spans),
        episodes=_episodes(rollouts),
        source=f"{store.config.uri} run {run}",
        threads=threads,
        **driver_rates(rollouts, timings, np.mean([agent_threads[agent].replicas for agent in agents])))


def pooled(calibrations: list[Costs]) -> Costs:
    """Several launches' costs as one: each figure the mean of theirs (on a shared host one launch of a configuration
    runs several percent faster or slower than the next), the workload their episodes taken in turn.

    Raises:
        ValueError: no launch, or the launches do not have the same agents.
    """
    if not calibrations:
        raise ValueError("no stored run to take costs from: name at least one")
    first, agents = calibrations[0], set(calibrations[0].engines)
    if odd := [costs.source for costs in calibrations if set(costs.engines) != agents]:
        raise ValueError(f"cannot pool costs of different agents: {first.source} has {sorted(agents)}, {odd} not")
    return replace(_mean(calibrations),
                   engines={agent: _mean([costs.engines[agent] for costs in calibrations]) for agent in agents},
                   trainers={agent: _mean([costs.trainers[agent] for costs in calibrations]) for agent in agents},
                   episodes=[episode for turn in zip(*(costs.episodes for costs in calibrations)) for episode in turn],
                   source="; ".join(costs.source for costs in calibrations))


def _mean(items: list):
    """A dataclass whose float fields (and tuples of floats, over the places all have) are the items' means."""
    means = {}
    for name in (f.name for f in fields(items[0])):
        values = [getattr(item, name) for item in items]
        if isinstance(values[0], float):
            means[name] = float(np.mean(values))
        elif isinstance(values[0], tuple):
            means[name] = tuple(float(np.mean(column)) for column in zip(*values))
    return replace(items[0], **means)


TOGETHER_S = 0.01
"""A wave whose requests were all sent within this is taken as sent together (a micro-batch's first turns: one turn
of the rollout's event loop sends them a few microseconds apart, within 2-3 ms for 256)."""


@dataclass
class _Wave:
    """A micro-batch's turns of one index for one agent: (sent, sampled, steps, engine seconds) of each request."""

    requests: list[tuple[float, float, int, float]] = field(default_factory=list)

    def sent_within(self) -> float:
        """Seconds from its first request sent to its last."""
        sent = [r[0] for r in self.requests]
        return max(sent) - min(sent)

    def span(self) -> tuple[float, float]:
        """From its first request sent to its last one sampled."""
        return min(r[0] for r in self.requests), max(r[1] for r in self.requests)

    def engine(self) -> float:
        """Its requests' engine seconds, summed: the steps that computed them."""
        return sum(r[3] for r in self.requests)

    def busy(self) -> float:
        """The seconds some request of it was in flight (their intervals' union: later turns' requests come as
        their episodes' replies do, with gaps between them)."""
        total, reach = 0.0, -math.inf
        for sent, sampled, _, _ in sorted(self.requests):
            total += max(sampled - max(sent, reach), 0.0)
            reach = max(reach, sampled)
        return total


def _engine_costs(rollouts, agent: str, threads: int, busy: list[tuple[float, float]]) -> EngineCosts:
    """From the agent's turn waves (a micro-batch's turns of one index) that ran while no trainer computed (``busy``:
    the trainers' intervals), so their seconds are the engine's alone: a step's fixed part and part per sequence
    from the requests' engine seconds of the waves sent together (:func:`_step_fit`; all waves where none was), a
    request's own work, by its turn in the episode, from the rest of the time the wave had requests in flight
    (sampled: a turn's span less its environment's reply)."""
    rows = rollouts.filter(pc.equal(rollouts.column("agent"), agent))
    waves: dict[tuple, _Wave] = defaultdict(_Wave)
    for step, mb, turn, response, seconds, start, end, observed in zip(
            rows.column("step").to_pylist(), rows.column("micro_batch").to_pylist(), rows.column("turn").to_pylist(),
            pc.list_value_length(rows.column("response_ids")).to_pylist(), rows.column("engine_seconds").to_pylist(),
            epoch_seconds(rows.column("rollout_start")), epoch_seconds(rows.column("rollout_end")),
            rows.column("observe_seconds").to_pylist()):
        waves[(step, mb, turn)].requests.append((start, end - (observed or 0.0), max(response, 1), seconds or 0.0))
    alone = {key: w for key, w in waves.items() if not _overlaps(*w.span(), busy)} or dict(waves)
    together = [w for w in alone.values() if w.sent_within() < TOGETHER_S]
    step, per_sequence = _step_fit(together or list(alone.values()))
    by_turn: dict[int, list[float]] = defaultdict(list)
    for (_, _, turn), w in alone.items():
        by_turn[turn].append(max(w.busy() - w.engine(), 0.0) / len(w.requests) * threads)
    request = float(np.median([seconds for values in by_turn.values() for seconds in values]))
    return EngineCosts(step * threads, per_sequence * threads, 0.0, request, tuple(
        float(np.median(by_turn[t])) if t in by_turn else request for t in range(max(by_turn) + 1)))


def _step_fit(waves: list[_Wave]) -> tuple[float, float]:
    """A step's seconds ``a + b x sequences`` from its requests' engine seconds: the wave's requests taken in
    together, the k-th step decodes the n_k of them with at least k tokens, and each is charged its share, so a
    request of L steps had ``a x sum(1 / n_k, k <= L) + b x L``, fitted over every request (least squares, both
    at least 0). Waves whose requests all end together do not tell a from b: then the step is taken as fixed."""
    rows, seconds = [], []
    for wave in waves:
        steps = np.array([r[2] for r in wave.requests])
        decoding = np.array([(steps >= k).sum() for k in range(1, steps.max() + 1)])
        shares = np.cumsum(1.0 / decoding)
        for _, _, length, engine in wave.requests:
            rows.append([shares[length - 1], length])
            seconds.append(engine)
    fixed = float(np.median([w.engine() / max(r[2] for r in w.requests) for w in waves]))
    x = np.array(rows)
    if len(rows) < 3 or np.linalg.matrix_rank(x) < 2:
        return fixed, 0.0
    a, b = nonnegative_fit(x, np.array(seconds))
    return (a, b) if a + b > 0 else (fixed, 0.0)


def _overlaps(start: float, end: float, intervals: list[tuple[float, float]]) -> bool:
    return any(begin < end and start < finish for begin, finish in intervals)


def _trainer_costs(updates, agent: str, own: AgentThreads, computed: dict[tuple, int],
                   rollout_spans: list[tuple[float, float]], timings: list[dict],
                   shares: dict[tuple, float], speedup: float) -> TrainerCosts:
    """``computed``: the tokens a trainer computes for each (step, micro-batch, agent): its turns' prompts and
    responses, as the simulation counts them (the stored ``tokens`` are the responses', which the loss counts);
    ``timings``: the agent's versions' ``timing.json`` records; ``shares``: the cores a call had
    (planner/threads.py's :func:`core_shares`); ``speedup``: what the trainer's threads bought."""
    rows = updates.filter(pc.equal(updates.column("agent"), agent))
    alone = np.array([not _overlaps(begin, end, rollout_spans) for begin, end in zip(
        epoch_seconds(rows.column("stage_started")), epoch_seconds(rows.column("stage_ended")))])
    if alone.any():  # the calls that ran while no engine sampled: the trainer's seconds alone
        rows = rows.filter(alone)
    tokens = np.array([computed.get((step, mb, agent), 0) for step, mb in zip(
        rows.column("step").to_pylist(), rows.column("micro_batch").to_pylist())], dtype=float)
    seconds = np.array([(s or 0.0) * shares.get((step, mb), 1.0) for s, step, mb in zip(
        rows.column("compute_seconds").to_pylist(), rows.column("step").to_pylist(),
        rows.column("micro_batch").to_pylist())]) * speedup
    call, per_token = nonnegative_fit(np.stack([np.ones_like(tokens), tokens], axis=1), seconds)
    apply, sync, commit = [], [], []
    for record in timings:
        applied = record.get("apply_seconds", 0.0)  # not recorded before 2026-11-27: counted in the commit
        apply.append(applied)
        sync.append(record["sync_seconds"] / own.replicas)
        commit.append(max(record["ended"] - record["started"] - record["sync_seconds"] - applied, 0.0))
    return TrainerCosts(call, per_token, *(float(np.median(values)) if values else 0.0
                                           for values in (apply, sync, commit)))


def _computed(rollouts) -> dict[tuple, int]:
    tokens: dict[tuple, int] = defaultdict(int)
    for step, mb, agent, prompt, response in zip(
            rollouts.column("step").to_pylist(), rollouts.column("micro_batch").to_pylist(),
            rollouts.column("agent").to_pylist(), pc.list_value_length(rollouts.column("prompt_ids")).to_pylist(),
            pc.list_value_length(rollouts.column("response_ids")).to_pylist()):
        tokens[(step, mb, agent)] += prompt + response
    return tokens


def _median_span(spans: list[Span], stage: str) -> float:
    """A stage's median seconds a micro-batch (0 when the run stored none)."""
    seconds = [span.ended - span.started for span in spans if span.stage == stage]
    return float(np.median(seconds)) if seconds else 0.0


def _handoff(spans: list[Span]) -> float:
    """Median over hand-offs of the seconds from when the next stage could start to when it did: each step's last
    micro-batch (in synchronous mode the one the step barrier waited for) from stage to stage (training also after
    the step's previous micro-batch's, on the one train thread), and each agent's publisher from the step's last
    training (0 when the run stored none)."""
    by = {(span.stage, span.step, span.micro_batch): span for span in spans if span.stage != "optimizer_step"}
    last: dict[int, int] = {}
    for _, step, mb in by:
        last[step] = max(last.get(step, mb), mb)
    hops = []
    for step, mb in last.items():
        for before, stage in pairwise(("rollouts", "environment_results", "rewards", "policy_updates")):
            if (before, step, mb) in by and (stage, step, mb) in by:
                ready = by[(before, step, mb)].ended
                if stage == "policy_updates" and ("policy_updates", step, mb - 1) in by:
                    ready = max(ready, by[("policy_updates", step, mb - 1)].ended)
                hops.append(by[(stage, step, mb)].started - ready)
    for span in spans:
        if span.stage == "optimizer_step" and ("policy_updates", span.step, last.get(span.step, -1)) in by:
            hops.append(span.started - by[("policy_updates", span.step, last[span.step])].ended)
    return float(np.median(np.maximum(hops, 0.0))) if hops else 0.0


def _rollout_overhead(rollouts) -> float:
    """Median over micro-batches of the stage's span less the span of its turns."""
    spans: dict[tuple, list[float]] = {}
    for step, mb, begin, end, turn_start, turn_end in zip(
            rollouts.column("step").to_pylist(), rollouts.column("micro_batch").to_pylist(),
            epoch_seconds(rollouts.column("stage_started")), epoch_seconds(rollouts.column("stage_ended")),
            epoch_seconds(rollouts.column("rollout_start")), epoch_seconds(rollouts.column("rollout_end"))):
        entry = spans.setdefault((step, mb), [begin, end, turn_start, turn_end])
        entry[2], entry[3] = min(entry[2], turn_start), max(entry[3], turn_end)
    return float(np.median([max((e - b) - (te - ts), 0.0) for b, e, ts, te in spans.values()]))


def _train_overhead(updates, agent_threads: dict[str, AgentThreads]) -> float:
    """Median over micro-batches of the train stage's span less its calls': the longest trainer's, where a trainer
    serving several agents (swapped) takes their calls one after another."""
    spans: dict[tuple, list] = {}
    for step, mb, agent, begin, end, seconds in zip(
            updates.column("step").to_pylist(), updates.column("micro_batch").to_pylist(),
            updates.column("agent").to_pylist(), epoch_seconds(updates.column("stage_started")),
            epoch_seconds(updates.column("stage_ended")), updates.column("compute_seconds").to_pylist()):
        entry = spans.setdefault((step, mb), [end - begin, defaultdict(float)])
        entry[1][worker_of(agent_threads, agent)] += seconds or 0.0
    return float(np.median([max(span - max(calls.values(), default=0.0), 0.0) for span, calls in spans.values()]))


def _episodes(rollouts) -> list[list[Turn]]:
    turns: dict[tuple, list[tuple[int, Turn]]] = defaultdict(list)
    for step, mb, episode, turn, agent, prompt, response, observed in zip(
            rollouts.column("step").to_pylist(), rollouts.column("micro_batch").to_pylist(),
            rollouts.column("episode").to_pylist(), rollouts.column("turn").to_pylist(),
            rollouts.column("agent").to_pylist(), pc.list_value_length(rollouts.column("prompt_ids")).to_pylist(),
            pc.list_value_length(rollouts.column("response_ids")).to_pylist(),
            rollouts.column("observe_seconds").to_pylist()):
        turns[(step, mb, episode)].append((turn, Turn(agent, prompt, response, observed or 0.0)))
    return [[t for _, t in sorted(episode, key=lambda item: item[0])] for _, episode in sorted(turns.items())]
