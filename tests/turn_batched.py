"""The turn-batched rollout, kept as the baseline trajectory-level rollout is compared with (tests/test_trajectories.py,
bench/pipeline/rollout.py): every episode of a micro-batch advances turn by turn, all episodes' prompts for the next
turn in one batched ``generate`` call to that turn's agent engine, all waiting for the slowest. Same seeds, prompts and
rows as the production rollout (stages/trajectories.py), so the two can be compared row for row. """

from __future__ import annotations

import time
from collections import Counter
from datetime import UTC, datetime

import pyarrow as pa
import ray

from marl_pipeline.environment import Environment, Turn
from marl_pipeline.hooks import hooks_of
from marl_pipeline.stages.rollout import (
    RolloutSettings,
    append_turn,
    engine_chat_session,
    episode_tasks,
    observe_reply,
    plan_tasks,
    turn_seeds,
)
from marl_pipeline.store import MicroBatchKey
from marl_pipeline.store.schema import ROLLOUTS, with_agent


def rollout_micro_batch(env: Environment, engines: dict[str, ray.actor.ActorHandle], key: MicroBatchKey,
                        settings: RolloutSettings) -> pa.Table:
    """Sample every episode of one micro-batch; returns the rollouts table (with an ``agent`` column). Episodes in
    ``turn_order`` only: a game's (``next_role``) have no common next turn to batch."""
    if hooks_of(env).next_role is not None:
        raise ValueError(f"{type(env).__name__} decides its turns (next_role); the turn-batched baseline plays "
                         f"turn_order only")
    episodes = episode_tasks(env, plan_tasks(env, key, settings.seed, settings.prompts_per_micro_batch),
                             settings.samples_per_prompt)
    transcripts: list[list[Turn]] = [[] for _ in episodes]
    columns: dict[str, list] = {name: [] for name in ROLLOUTS.names + ["agent"]}
    chats = engine_chat_session(env, engines)
    adapters = settings.episode_adapters(env.turn_order)
    replies = hooks_of(env).observe is not None  # without observe, a turn's reply time is none, not 0
    for turn, role in enumerate(env.turn_order):
        requests = [chats.request(e, role, turn, env.render_prompt(role, task, transcripts[e]))
                    for e, (_, _, task) in enumerate(episodes)]
        seeds = turn_seeds(settings.seed, key, turn, len(episodes))
        start = datetime.now(UTC)
        version, completions = ray.get(engines[role].generate.remote(
            [settings.request(role, request, seed, adapters[turn]) for request, seed in zip(requests, seeds)]))
        for e, ((p, trajectory, task), request, completion) in enumerate(zip(episodes, requests, completions)):
            chats.record(e, role, completion.text, completion.response_ids)
            asked = time.perf_counter()
            observation, error = observe_reply(env, role, task, [*transcripts[e], Turn(role, completion.text)])
            observed = time.perf_counter() - asked if replies else None
            transcripts[e].append(Turn(role, completion.text, observation))
            append_turn(columns, key, task, p, trajectory, e, turn, role, chats.prompt_text(role, request),
                        completion, version, start, datetime.now(UTC), observation, error, adapter=adapters[turn],
                        observe_seconds=observed)
    failed = {e for e, status in zip(columns["episode"], columns["status"]) if status != "ok"}
    short = Counter(episodes[e][0] for e in failed)  # per prompt: its episodes that did not finish
    columns["group_shortfall"] = [short[episodes[e][0]] for e in columns["episode"]]
    return pa.table(columns, schema=with_agent(ROLLOUTS))
