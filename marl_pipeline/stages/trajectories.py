"""Trajectory-level rollout: every episode of a micro-batch is its own task on the asynchronous engines.

An episode's next turn is requested as soon as its previous turn and the environment's reply to it are done;
it never waits for other episodes' turns, so turns of different agents in different episodes overlap, and a
long generation or a slow reply holds only its own episode. The engines batch whatever requests are in flight
at each step (inference/async_engine.py). A reply (``observe``) runs on a driver thread, or on the run's action
pool when it costs real time (``pipeline.rollout.observe_on``). The micro-batch is committed once every
episode has finished, or been cut at ``pipeline.rollout.episode_timeout_s``.

What a stored micro-batch keeps, compared with the turn-batched baseline (tests/turn_batched.py), for the same
weights: the same tasks, prompts and seeded requests (each request's seed is a function of run seed, step,
micro-batch, turn and episode, never of timing), and the same rows in the same order. vLLM's seeded sampling
draws each request's tokens from its own generator, so a request's tokens do not depend on which other requests
share its batch, up to floating point: the batch each request lands in varies from run to run here, and a
kernel may sum in another order for another batch shape. What does depend on timing: the timestamps, the
policy version when a weight update lands during the micro-batch (each turn stores the version that sampled
it, never older than the staleness gate allowed), and which episodes a time limit cuts.

A timed-out episode: its request in flight is aborted, the turns it sampled are stored with status ``timeout``
(one whose reply was cut has no observation; an episode cut in its first generation stores no row, so its group
is one episode smaller), and the environment stage records the episode failed, like one whose reply raised or
whose conversation outgrew its engine's context (status ``prompt_too_long``: vLLM refused a prompt over
``max_model_len``, which used to stop the launch). In GRPO it stays in its group with reward 0 for every agent: it
lowers its group's mean, raising the others' advantages, and its stored turns get a negative advantage when the
group earned anything. So the time limit acts as a penalty on the turns of episodes that ran too long; set it well
above the normal episode time, or the penalty also hits episodes that were merely unlucky with a slow reply.

Over-sampling (``pipeline.rollout.oversample``: k): each group starts n + k episodes and keeps the first n that
finish (every turn and reply done without error). The n-th cuts the group's others at once (their requests aborted,
as the time limit does); their turns are stored with status ``dropped`` and why, with no environment, reward or
training row (stages/episodes.py's ``kept_turns``). A group that ends with fewer than n finished keeps failed
episodes up to n, as without over-sampling. Every row carries its group's shortfall (n minus its finished episodes)
and dropped episodes, which the step's health sums. Which episodes a group keeps depends on timing, like a time limit.

Replicas (``agents.<name>.engine.replicas``): each turn's request goes to the replica the agent's router picks
(inference/router.py: the episode's own replica for its later turns), and the row names it (``engine``:
``<agent>/<replica>``). A request whose replica dies (Ray's ``RayActorError``) is sent again, same id and seed, to
another replica; the replica set restarts the dead one (inference/replicas.py). Only finished turns become rows, so
a retried turn is stored once, and the episode's earlier turns are kept: nothing is lost or duplicated.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime

import pyarrow as pa
import ray

from marl_pipeline.actions.pool import ActionPool
from marl_pipeline.actions.worker import Job
from marl_pipeline.config import ExperimentConfig, RolloutConfig
from marl_pipeline.config.agent import turn_adapter
from marl_pipeline.environment import Environment, Turn
from marl_pipeline.hooks import hooks_of
from marl_pipeline.inference.engine import GenerationRequest, PromptTooLong
from marl_pipeline.inference.replicas import EngineReplicas, as_replicas
from marl_pipeline.inference.router import EpisodeRoute, NoReplica
from marl_pipeline.stages.rollout import (
    RolloutSettings,
    append_turn,
    engine_chat_session,
    episode_tasks,
    next_turn,
    observe_reply,
    plan_tasks,
    turn_seeds,
)
from marl_pipeline.store import MicroBatchKey
from marl_pipeline.store.schema import ROLLOUTS, with_agent

MAX_ATTEMPTS = 3
"""Replicas a turn's request is tried on before the micro-batch fails (a replica dying is rare; three in a row
means something else is wrong)."""
SATURATED_POLL_S = 0.005
"""How often a new episode looks again for a replica with room while every one is saturated."""


def sample_micro_batch(env: Environment, engines: dict[str, ray.actor.ActorHandle | EngineReplicas],
                       key: MicroBatchKey, config: ExperimentConfig, pool: ActionPool | None = None) -> pa.Table:
    """The rollouts table of one micro-batch (the train job and recomputation)."""
    return rollout_trajectories(env, engines, key, RolloutSettings.from_config(config), config.pipeline.rollout, pool)


def rollout_trajectories(env: Environment, engines: dict[str, ray.actor.ActorHandle | EngineReplicas],
                         key: MicroBatchKey, settings: RolloutSettings, options: RolloutConfig,
                         pool: ActionPool | None = None) -> pa.Table:
    """Sample every episode of one micro-batch as its own task; ``engines`` are each agent's ``AsyncRolloutEngine``
    actor, or its replica set."""
    if options.observe_on == "action_pool" and pool is None:
        raise ValueError("pipeline.rollout.observe_on is 'action_pool' but the run has no action pool: only an "
                         "action environment (one with actions and run_action) has one; use 'thread'")
    return asyncio.run(_MicroBatch(env, engines, key, settings, options, pool).run())


@dataclass
class _Sampled:
    """A turn kept once sampled: its reply's fields (``end``, ``observation``, ``error``, ``observe_seconds``) are
    filled when the reply comes; a turn cut while its reply ran keeps the time it was sampled as its end."""

    turn: int
    role: str
    prompt: str
    completion: object
    version: int
    start: datetime
    engine: str
    end: datetime
    adapter: str | None = None
    observation: str | None = None
    error: str | None = None
    observe_seconds: float | None = None


class _MicroBatch:
    """One micro-batch's episodes in flight, and the turns each has finished."""

    def __init__(self, env: Environment, engines: dict[str, ray.actor.ActorHandle | EngineReplicas],
                 key: MicroBatchKey, settings: RolloutSettings, options: RolloutConfig,
                 pool: ActionPool | None) -> None:
        self.env, self.key, self.settings, self.options, self.pool = env, key, settings, options, pool
        replicas = as_replicas(engines)  # per agent; per role below (a shared policy's roles share its replicas)
        self.engines = {role: replicas[settings.agent_of(role)] for role in dict.fromkeys(env.turn_order)}
        self.n = settings.samples_per_prompt
        tasks = plan_tasks(env, key, settings.seed, settings.prompts_per_micro_batch)
        # per episode: (prompt, trajectory, task); n + k per prompt with over-sampling, the k after every prompt's n
        self.episodes = episode_tasks(env, tasks, self.n, options.extra_episodes(self.n))
        self.groups = [[e for e, (q, _, _) in enumerate(self.episodes) if q == p] for p in range(len(tasks))]
        self.done: list[list[int]] = [[] for _ in tasks]  # per prompt: its episodes that finished, in that order
        self.dropped: dict[int, str] = {}  # per episode over-sampling dropped: why
        self.tasks: list[asyncio.Task] = []
        self.max_turns = hooks_of(env).max_turns
        self.seeds = [turn_seeds(settings.seed, key, turn, len(self.episodes)) for turn in range(self.max_turns)]
        self.chats = engine_chat_session(env, {role: r.primary() for role, r in self.engines.items()})
        self.finished: list[list[_Sampled]] = [[] for _ in self.episodes]  # per episode: its sampled turns
        self.in_flight: dict[int, tuple[ray.actor.ActorHandle, str]] = {}  # per episode: (engine, request id)
        self.replied = [0] * len(self.episodes)  # per episode: turns whose reply came back
        self.cut: dict[int, tuple[str, str]] = {}  # per episode cut short: its rows' status and why
        self.threads: ThreadPoolExecutor | None = None
        self.batches = _Batches()
        self.routes = [EpisodeRoute((key, e), options.lanes) for e in range(len(self.episodes))]

    async def run(self) -> pa.Table:
        observes = hooks_of(self.env).observe is not None and self.options.observe_on == "thread"
        self.threads = (ThreadPoolExecutor(min(self.options.observe_threads, len(self.episodes)),
                                           thread_name_prefix="observe") if observes else None)
        started = time.monotonic()
        self.tasks = [asyncio.ensure_future(self._timed(e, started)) for e in range(len(self.episodes))]
        try:
            await asyncio.gather(*self.tasks)
        except BaseException:
            await self._abort(list(self.in_flight))  # nothing of a failed micro-batch is left running
            raise
        finally:
            self.batches.close()
            if self.threads is not None:
                self.threads.shutdown(wait=False, cancel_futures=True)  # a reply past the limit is abandoned
        self._fill_short_groups()
        return self._table()

    async def _timed(self, e: int, started: float) -> None:
        try:
            await self._limited(e, started)
        except asyncio.CancelledError:
            if e in self.dropped:  # over-sampling cut it: its group had its n episodes first
                return
            raise
        await self._ended(e)

    async def _limited(self, e: int, started: float) -> None:
        limit = self.options.episode_timeout_s
        if limit is None:
            return await self._episode(e)
        try:
            await asyncio.wait_for(self._episode(e), max(0.0, started + limit - time.monotonic()))
        except TimeoutError:
            await self._abort([e])
            self.cut[e] = ("timeout", f"episode over its time limit of {limit:g} s "
                                      f"(pipeline.rollout.episode_timeout_s) with {self._progress(e)}")

    def _progress(self, e: int) -> str:
        return f"{self.replied[e]} of {self.max_turns} turns and their replies done"

    def _failure(self, e: int) -> str | None:
        """Why an ended episode failed (cut short: its time limit, its context; or a reply raised); None: finished."""
        return self.cut.get(e, (None, None))[1] or next((turn.error for turn in self.finished[e] if turn.error), None)

    async def _ended(self, e: int) -> None:
        """Counts a finished episode to its group; the group's n-th cuts the group's others (over-sampling)."""
        if self._failure(e) is not None:
            return  # kept or dropped when the micro-batch ends (_fill_short_groups)
        p = self.episodes[e][0]
        self.done[p].append(e)
        if len(self.done[p]) < self.n:
            return
        cut = [x for x in self.groups[p] if x not in self.done[p] and x not in self.dropped]
        for x in cut:
            failure = self._failure(x)
            self.dropped[x] = (f"dropped: its group had {self.n} finished episodes first (pipeline.rollout.oversample);"
                               + (f" it failed: {failure}" if failure else f" cut with {self._progress(x)}"))
            self.tasks[x].cancel()  # nothing to a task that ended
        await self._abort(cut)  # their requests in flight: the engines' slots are free at once

    def _fill_short_groups(self) -> None:
        """A group with fewer than n finished episodes keeps failed ones (in trajectory order) up to n, as without
        over-sampling; it drops the rest."""
        for p, group in enumerate(self.groups):
            failed = [x for x in group if x not in self.done[p] and x not in self.dropped and self.finished[x]]
            for x in failed[max(0, self.n - len(self.done[p])):]:
                self.dropped[x] = (f"dropped: its group, with {len(self.done[p])} of {self.n} episodes finished, "
                                   f"kept {self.n - len(self.done[p])} failed ones before it; it failed: "
                                   f"{self._failure(x)}")

    async def _episode(self, e: int) -> None:
        try:
            await self._turns(e)
        finally:
            self.routes[e].end({id(r.router): r.router for r in self.engines.values()}.values())

    async def _turns(self, e: int) -> None:
        _, _, task = self.episodes[e]
        transcript: list[Turn] = []
        while (role := next_turn(self.env, task, transcript)) is not None:
            turn = len(transcript)
            request = self.chats.request(e, role, turn, self.env.render_prompt(role, task, transcript))
            request_id = f"{self.key.run}/{self.key.step}/{self.key.micro_batch}/{e}/{turn}"
            start = datetime.now(UTC)
            adapter = turn_adapter(self.settings.turn_adapters, role, [earlier.role for earlier in transcript])
            try:
                sampled, replica = await self._generate(
                    e, role, request_id, self.settings.request(role, request, self.seeds[turn][e], adapter))
            except PromptTooLong as error:  # the conversation outgrew the engine's context: the episode fails here
                self.cut[e] = ("prompt_too_long", f"turn {turn}'s prompt is over max_model_len: {error}")
                return
            completion = sampled.completion
            self.chats.record(e, role, completion.text, completion.response_ids)
            # Kept before the reply comes: a turn sampled and then cut while its reply ran is stored too.
            kept = _Sampled(turn, role, self.chats.prompt_text(role, request), completion, sampled.version, start,
                            f"{self.settings.agent_of(role)}/{replica}", datetime.now(UTC), adapter)
            self.finished[e].append(kept)
            kept.observation, kept.error = await self._observe(role, task, [*transcript, Turn(role, completion.text)])
            transcript.append(Turn(role, completion.text, kept.observation))
            replied = datetime.now(UTC)
            kept.observe_seconds, kept.end = (replied - kept.end).total_seconds(), replied
            self.replied[e] += 1

    async def _generate(self, e: int, role: str, request_id: str, request: GenerationRequest) -> tuple[object, int]:
        """One turn's request on the replica the router picks; sent again (same id and seed) to another replica
        when its replica dies. -> (Sampled, the replica that served it)."""
        replicas, failures = self.engines[role], []
        while True:
            replica = await self._acquire(replicas, self.routes[e])
            handle = replicas.handle(replica)
            self.in_flight[e] = (handle, request_id)
            served = False
            try:
                sampled = await self.batches.submit(handle, request_id, request)
                served = True
            except ray.exceptions.RayActorError as error:
                # Died, or unreachable (ActorUnavailableError is one too): Ray never restarts our engine actors, so
                # an unreachable replica is treated as lost, replaced, and the request goes elsewhere.
                self.in_flight.pop(e, None)
                replicas.replica_died(replica, handle)
                failures.append(f"{replicas.agent}/{replica}: {type(error).__name__}")
                if len(failures) >= MAX_ATTEMPTS:
                    raise RuntimeError(f"request {request_id!r} failed on {len(failures)} replicas in turn "
                                       f"({'; '.join(failures)})") from error
                continue
            finally:  # a cancelled request stays in in_flight: the time limit's _abort frees its engine slot
                self.routes[e].release(replicas.router, replica, served)
            self.in_flight.pop(e, None)
            return sampled, replica

    @staticmethod
    async def _acquire(replicas: EngineReplicas, route: EpisodeRoute) -> int:
        """A replica for the episode's next turn (``EpisodeRoute.acquire``), waiting while all are busy or down."""
        while True:
            try:
                replica = route.acquire(replicas.router)
            except NoReplica as down:
                if not replicas.restarting():  # with why, if a restart failed (a hybrid agent's process died, say)
                    failed = replicas.restart_errors[-1:]
                    raise NoReplica(f"{replicas.agent}: {down}" + "".join(f"; the last restart failed: {error}"
                                                                          for error in failed)) from down
                replica = None
            if replica is not None:
                return replica
            await asyncio.sleep(SATURATED_POLL_S)

    async def _observe(self, role: str, task: dict, transcript: list[Turn]) -> tuple[str | None, str | None]:
        if hooks_of(self.env).observe is None:
            return None, None
        if self.options.observe_on == "action_pool":
            job = Job(observe_reply, (self.env, role, task, transcript))
            outcome = await asyncio.wrap_future(self.pool.submit(job))
            if outcome.status != "ok":
                return None, f"observe on the action pool: {outcome.status}: {outcome.error}"
            return outcome.value
        return await asyncio.get_running_loop().run_in_executor(self.threads, observe_reply, self.env, role, task,
                                                                transcript)

    async def _abort(self, episodes: list[int]) -> None:
        by_engine: dict[ray.actor.ActorHandle, list[str]] = {}
        for e in episodes:
            if (entry := self.in_flight.pop(e, None)) is not None:
                by_engine.setdefault(entry[0], []).append(entry[1])
                self.batches.withdraw(*entry)  # one submitted in this turn of the loop is never sent
        # return_exceptions: a replica that died has nothing left to abort.
        await asyncio.gather(*[engine.abort.remote(ids) for engine, ids in by_engine.items()], return_exceptions=True)

    def _table(self) -> pa.Table:
        """The rows in the turn-batched rollout's order (turn, then episode), so both modes store the same table."""
        columns: dict[str, list] = {name: [] for name in ROLLOUTS.names + ["agent"]}
        rows = sorted(((kept.turn, e), kept) for e, turns in enumerate(self.finished) for kept in turns)
        # per prompt: (n minus its finished episodes, or 0; its dropped episodes)
        groups = [(max(0, self.n - len(done)), sum(x in self.dropped for x in group))
                  for done, group in zip(self.done, self.groups)]
        replies = hooks_of(self.env).observe is not None  # without observe, a turn's reply time is none, not 0
        for (turn, e), kept in rows:
            p, trajectory, task = self.episodes[e]
            (status, cut), dropped = self.cut.get(e, (None, None)), self.dropped.get(e)
            status = "dropped" if dropped else status
            append_turn(columns, self.key, task, p, trajectory, e, turn, kept.role, kept.prompt, kept.completion,
                        kept.version, kept.start, kept.end, kept.observation, dropped or kept.error or cut,
                        status=status, engine=kept.engine, adapter=kept.adapter, group=groups[p],
                        observe_seconds=kept.observe_seconds if replies else None,
                        agent=self.settings.agent_of(kept.role))
        return pa.table(columns, schema=with_agent(ROLLOUTS))


_messages = [0]  # a list: incremented in place by each micro-batch's event loop (a lost increment among two is noise)


def rollout_messages() -> int:
    """This process's rollout messages with the engines so far: streaming calls sent and chunks of results back (the
    driver's CPU follows them more than turns: two replicas split a wave into more of both, planner/cpu.py)."""
    return _messages[0]


class _Batches:
    """Requests to an engine replica go in batches: those submitted in one turn of the event loop (a micro-batch's
    first turns, or the turns whose previous ones finished in one engine step) are one streaming call
    (``AsyncRolloutEngine.generate_stream``), and each request's future is settled as its result streams back: a Ray
    call per request would cost more than a tiny model's turn (bench/pipeline/bound.py)."""

    def __init__(self) -> None:
        self.waiting: dict[ray.actor.ActorHandle, list[tuple[str, GenerationRequest]]] = {}
        self.futures: dict[str, asyncio.Future] = {}
        self.streams: set[asyncio.Task] = set()

    def submit(self, handle: ray.actor.ActorHandle, request_id: str, request: GenerationRequest) -> asyncio.Future:
        """A future of the request's ``Sampled``; it raises what ended the request (``RayActorError`` when the
        replica died)."""
        loop = asyncio.get_running_loop()
        self.futures[request_id] = future = loop.create_future()
        if handle not in self.waiting:
            self.waiting[handle] = []
            loop.call_soon(self._send, handle)  # after the tasks ready now have submitted theirs
        self.waiting[handle].append((request_id, request))
        return future

    def withdraw(self, handle: ray.actor.ActorHandle, request_id: str) -> None:
        """Takes back a request not yet sent (its episode was cut in the turn of the loop that submitted it)."""
        if handle in self.waiting:
            self.waiting[handle] = [entry for entry in self.waiting[handle] if entry[0] != request_id]

    def _send(self, handle: ray.actor.ActorHandle) -> None:
        if not (batch := self.waiting.pop(handle)):
            return
        _messages[0] += 1
        task = asyncio.ensure_future(self._stream(handle, batch))
        self.streams.add(task)
        task.add_done_callback(self.streams.discard)

    async def _stream(self, handle: ray.actor.ActorHandle, batch: list[tuple[str, GenerationRequest]]) -> None:
        try:
            async for ref in handle.generate_stream.options(num_returns="streaming").remote(batch):
                _messages[0] += 1
                for request_id, result in await ref:
                    self._settle(request_id, result)
        except Exception as error:  # the replica died: every request of the batch not yet settled fails with it
            for request_id, _ in batch:
                self._settle(request_id, error)

    def _settle(self, request_id: str, result: object) -> None:
        future = self.futures.pop(request_id, None)
        if future is None or future.done():  # settled, or its episode gave up on it (a time limit)
            return
        if isinstance(result, BaseException):
            future.set_exception(result)
        else:
            future.set_result(result)

    def close(self) -> None:
        """Stops reading the streams of a micro-batch that ended (its requests in flight are aborted by then)."""
        for task in self.streams:
            task.cancel()
