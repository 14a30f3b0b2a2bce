"""What the rollout stage (stages/trajectories.py) is made of: the micro-batch's tasks, each request's seed, chat
prompts, the environment's replies and one row per turn.

Each agent's prompt is rendered from the transcript so far (who sees what is the plugin's
call). After each turn, a plugin with ``observe`` replies to the episode (a tool's result, a check of
the answer's format, a hidden state revealed bit by bit): the reply is stored with the turn and later
turns see it as ``Turn.observation``, so an agent's next turn can depend on the environment's reply.
A reply that raises marks that turn ``observe_failed`` (the error stored) and the episode goes on; the
environment stage then records the whole episode as failed. Each request carries its own seed derived
from (run seed, step, micro-batch, turn, episode), so a micro-batch's rollout is reproducible for the
same policy weights.

A plugin may render a turn as chat messages instead of a string: the agent's tokenizer (read in the driver from
the directory its engine loaded) applies its chat template once, those ids are sent to the engine, stored and
trained on, and the agent's later turns in the episode extend them (inference/chat.py). Stored ``prompt_text`` is
then the ids decoded, for display only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import ray

from marl_pipeline.config import ExperimentConfig
from marl_pipeline.config.agent import episode_adapters
from marl_pipeline.environment import Environment, Task, Turn, roles_of
from marl_pipeline.hooks import hooks_of
from marl_pipeline.inference.chat import ChatSession, ChatTokenizer, fetched_chat_tokenizer
from marl_pipeline.inference.engine import Completion, GenerationRequest
from marl_pipeline.store import MicroBatchKey


@dataclass(frozen=True)
class RolloutSettings:
    """The slice of the config the rollout stage needs."""

    seed: int
    prompts_per_micro_batch: int
    samples_per_prompt: int
    max_new_tokens: dict[str, int]
    """Per role, the longest reply of one of its turns, in tokens (its agent's ``algorithm.max_new_tokens``)."""
    temperature: dict[str, float]
    """Per role, its sampling temperature (its agent's ``algorithm.temperature``)."""
    turn_adapters: dict[str, dict[str, list[int]]] = field(default_factory=dict)
    """Per agent, its ``turn_adapters``: named adapters and the own turns they serve."""
    agents: dict[str, str] = field(default_factory=dict)
    """The agent playing each role (``ExperimentConfig.role_agents``), whose engines sample its turns and whose
    rows they are; a role not here is played by the agent named as it."""

    @classmethod
    def from_config(cls, config: ExperimentConfig) -> RolloutSettings:
        """The one place the rollout settings are cut from the config (the train job and recomputation alike)."""
        pipeline = config.pipeline
        agents = config.role_agents()
        algorithms = {role: config.algorithm_of(agent) for role, agent in agents.items()}
        return cls(config.seed, pipeline.prompts_per_micro_batch, pipeline.samples_per_prompt,
                   {role: a.max_new_tokens for role, a in algorithms.items()},
                   {role: a.temperature for role, a in algorithms.items()},
                   config.turn_adapters(), agents)

    def agent_of(self, role: str) -> str:
        """The agent that plays ``role``."""
        return self.agents.get(role, role)

    def request(self, role: str, prompt: str | list[int], seed: int, adapter: str | None = None
                ) -> GenerationRequest:
        """A turn of ``role``'s sampling request."""
        return GenerationRequest(prompt, seed, self.max_new_tokens[role], self.temperature[role], adapter)

    def episode_adapters(self, turn_order: list[str]) -> list[str | None]:
        """The named adapter that serves each turn of an episode (None: the policy's weights alone)."""
        return episode_adapters(self.turn_adapters, turn_order)


def token_demand(rollouts: pa.Table, agents: list[str]) -> dict[str, int]:
    """Each agent's tokens (prompt + response, what its engines computed) in a rollouts table; 0 for an agent
    with no turn in it."""
    prompt = pc.list_value_length(rollouts.column("prompt_ids"))
    response = pc.list_value_length(rollouts.column("response_ids"))
    table = pa.table({"agent": rollouts.column("agent"), "tokens": pc.add(prompt, response)})
    sums = table.group_by("agent").aggregate([("tokens", "sum")]).to_pydict()
    found = dict(zip(sums["agent"], sums["tokens_sum"]))
    return {agent: int(found.get(agent, 0)) for agent in agents}


def plan_tasks(env: Environment, key: MicroBatchKey, seed: int, count: int) -> list[Task]:
    """The task prompts of a micro-batch: a pure function of (seed, step, micro-batch)."""
    return env.sample_tasks(np.random.default_rng([seed, key.step, key.micro_batch]), count)


def episode_tasks(env: Environment, tasks: list[Task], samples_per_prompt: int,
                  extra: int = 0) -> list[tuple[int, int, Task]]:
    """Each episode's (prompt index, trajectory, task), prompt by prompt: the planned task as the environment's
    optional ``episode_task`` hook gives it to that trajectory of the group, else the planned task itself. The
    ``extra`` episodes of over-sampling (trajectories n..n+extra-1) come after every prompt's n, so the first n keep
    their episode numbers and seeds whatever ``extra`` is."""
    vary = hooks_of(env).episode_task
    places = [(p, t) for p in range(len(tasks)) for t in range(samples_per_prompt)]
    places += [(p, samples_per_prompt + t) for p in range(len(tasks)) for t in range(extra)]
    return [(p, trajectory, vary(tasks[p], trajectory) if vary is not None else tasks[p]) for p, trajectory in places]


def next_turn(env: Environment, task: Task, transcript: list[Turn]) -> str | None:
    """The role that speaks next in an episode, or None once it is over: the roles of ``turn_order`` in turn, or,
    for a plugin with ``next_role`` (a game whose moves decide whose turn it is and when it ends), the role it
    names, the episode cut at its ``max_turns``. The one rule of the rollout and the team's evaluation."""
    hooks = hooks_of(env)
    if len(transcript) >= hooks.max_turns:
        return None
    if hooks.next_role is None:
        return env.turn_order[len(transcript)]
    role = hooks.next_role(task, transcript)
    if role is not None and role not in roles_of(type(env)):
        raise ValueError(f"{type(env).__name__}.next_role named {role!r} after {len(transcript)} turns; the roles "
                         f"are {list(roles_of(type(env)))}")
    return role


def turn_seeds(seed: int, key: MicroBatchKey, turn: int, episodes: int) -> list[int]:
    """Each episode's seed for one turn: a function of (run seed, step, micro-batch, turn, episode) only, never of
    when the request runs (tests/turn_batched.py's baseline sends the same seeded requests) nor of how many
    episodes there are (``generate_state``'s first m words are the same for any longer state)."""
    state = np.random.SeedSequence([seed, key.step, key.micro_batch, turn]).generate_state(episodes)
    return [int(s) for s in state]


def engine_chat_session(env: Environment, engines: dict[str, ray.actor.ActorHandle]) -> ChatSession:
    """A chat session with the tokenizers of the agents' engines (asked for only when an agent is first given chat
    messages). They come from the engines through Ray, once per policy directory: an engine's directory is on its
    own node (a cache of an S3 store), maybe not on the driver's."""
    def tokenizer(role: str) -> ChatTokenizer:
        engine = engines[role]
        return fetched_chat_tokenizer(ray.get(engine.model_directory.remote()),
                                      lambda: ray.get(engine.tokenizer.remote()))

    return ChatSession(getattr(env, "name", type(env).__name__), tokenizer)


def observe_reply(env: Environment, role: str, task: Task, transcript: list[Turn]) -> tuple[str | None, str | None]:
    """(the environment's reply to the last turn, None) or (None, why it failed); (None, None) without ``observe``."""
    observe = hooks_of(env).observe
    if observe is None:
        return None, None
    try:
        reply = observe(role, task, transcript)
    except Exception as exc:
        return None, f"observe: {type(exc).__name__}: {exc}"
    if reply is not None and not isinstance(reply, str):
        return None, f"observe: returned {type(reply).__name__}, expected str or None"
    return reply, None


def append_turn(columns: dict[str, list], key: MicroBatchKey, task: Task, prompt_index: int, trajectory: int,
                episode: int, turn: int, role: str, prompt: str, completion: Completion, version: int,
                start: datetime, end: datetime, observation: str | None, error: str | None,
                status: str | None = None, engine: str | None = None, adapter: str | None = None,
                group: tuple[int, int] = (0, 0), observe_seconds: float | None = None, agent: str | None = None
                ) -> None:
    """One turn's row; ``status`` defaults to ``ok``, or ``observe_failed`` when there is an ``error``; ``engine``
    names the replica that served it (default ``<agent>/0``), ``adapter`` the named adapter it used, ``group`` its
    group's (shortfall, dropped episodes), ``observe_seconds`` how long the environment's reply took, ``agent`` who
    played the role (default: the agent named as it)."""
    agent = agent or role
    input_id = f"{key.step}-{key.micro_batch}-{prompt_index}"  # the prompt's n episodes are its GRPO group
    row = {
        "sample_id": f"{input_id}_{turn}_{trajectory}", "episode": episode, "task_id": str(task["id"]),
        "group_id": input_id, "trajectory": trajectory, "role": role, "turn": turn, "task": json.dumps(task),
        "policy_version": version, "engine": engine or f"{agent}/0", "adapter": adapter, "prompt_text": prompt,
        "response_text": completion.text,
        "prompt_ids": completion.prompt_ids, "response_ids": completion.response_ids,
        "logprobs": completion.logprobs, "finish_reason": completion.finish_reason, "observation": observation,
        "rollout_start": start, "rollout_end": end, "engine_seconds": completion.engine_seconds,
        "observe_seconds": observe_seconds,
        "group_shortfall": group[0], "group_dropped": group[1],
        "status": status or ("ok" if error is None else "observe_failed"),
        "error": error, "agent": agent,
    }
    for name, value in row.items():
        columns[name].append(value)
