"""PettingZoo's AEC games as teams: each of a game's agents is a role, and the agent of the config playing that role
plays it (``pettingzoo``, the ``environments`` extra).

An AEC game (PettingZoo's Agent Environment Cycle: agents act one at a time, the game names the next in
``agent_selection``) fits the plugin API's ``next_role``. What has to be given is text in and out, which PettingZoo
leaves to the game: :func:`aec_game` takes the game's factory, a ``render`` of an agent's observation as its prompt
(the identity for a game whose observations are text) and a ``parse`` of a reply into the game's action. A reply
``parse`` cannot read ends the episode, lost by the agent that wrote it: the game never sees it. PettingZoo's own
games observe arrays; rendering them is the plugin's one job (a board's cells as text, say), not the adapter's.

As with TextArena (environments/textarena_games.py), every hook replays the game from the task's seed and the replies
so far, so it stays a pure function of its arguments. The reward of an agent is the game's cumulative reward,
TextArena's and PettingZoo's classic convention of win 1, draw 0, loss -1 mapped to 1, 0.5, 0 (clipped to them).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, ClassVar

import numpy as np
from pydantic import BaseModel, ConfigDict

from environments.games import outcome_reward, sample_game_tasks
from marl_pipeline.environment import ActionResult, Turn

FIRST_INTEGER = re.compile(r"-?\d+")


def integer_move(reply: str, space: Any) -> int | None:
    """The first integer of ``reply`` (``[4]``, ``4``, ``take 4``) if ``space`` (a Discrete) contains it."""
    match = FIRST_INTEGER.search(reply)
    if match is None:
        return None
    move = int(match.group())
    return move if space.contains(np.int64(move)) else None


class AECOptions(BaseModel):
    """``environment.options`` of an AEC game (none yet)."""

    model_config = ConfigDict(extra="forbid")


class AECGame:
    """The environment of one AEC game: made by :func:`aec_game`."""

    name: ClassVar[str]
    turn_order: ClassVar[tuple[str, ...]]
    """The game's ``possible_agents``, one role each (the game decides who acts: ``next_role``)."""
    max_turns: ClassVar[int]
    Options: ClassVar[type[BaseModel]] = AECOptions
    make: ClassVar[Callable[[], Any]]
    render: ClassVar[Callable[[Any, str], str]]
    parse: ClassVar[Callable[[str, Any], Any]]

    def __init__(self, options: AECOptions) -> None:
        self.options = options

    def _replay(self, task: dict, transcript: list[Turn]) -> tuple[Any, list[dict], dict[str, float]]:
        """The game after the replies; per reply its agent and the action it was read as (None: unreadable); and
        each agent's reward summed over the steps (the step's ``rewards``, read before finished agents leave)."""
        env = type(self).make()
        env.reset(seed=int(task["seed"]))
        played, totals = [], dict.fromkeys(self.turn_order, 0.0)
        for turn in transcript:
            self._skip_finished(env)
            agent = env.agent_selection
            action = type(self).parse(turn.text, env.action_space(agent))
            played.append({"agent": agent, "action": action})
            if action is None:
                break
            env.step(action)
            for rewarded, reward in env.rewards.items():
                totals[rewarded] += float(reward)
        self._skip_finished(env)
        return env, played, totals

    @staticmethod
    def _skip_finished(env: Any) -> None:
        """Steps the agents that are done out of the cycle, as AEC wants (``step(None)``)."""
        while env.agents and (env.terminations[env.agent_selection] or env.truncations[env.agent_selection]):
            env.step(None)

    def sample_tasks(self, rng: np.random.Generator, count: int) -> list[dict]:
        return sample_game_tasks(rng, count)

    def next_role(self, task: dict, transcript: list[Turn]) -> str | None:
        env, played, _ = self._replay(task, transcript)
        if (played and played[-1]["action"] is None) or not env.agents:
            return None
        return env.agent_selection

    def render_prompt(self, role: str, task: dict, transcript: list[Turn]) -> str:
        env, _, _ = self._replay(task, transcript)
        if env.agent_selection != role:
            raise ValueError(f"{self.name}: asked for {role}'s prompt, but {env.agent_selection} acts next")
        return type(self).render(env.observe(role), role)

    def execute(self, task: dict, transcript: list[Turn]) -> list[ActionResult]:
        env, played, totals = self._replay(task, transcript)
        results = []
        for index, move in enumerate(played):
            readable = move["action"] is not None
            info: dict[str, Any] = {"agent": move["agent"], "action": None if not readable else int(move["action"])}
            if index == len(played) - 1:
                info["finished"] = not readable or not env.agents
                info["rewards"] = totals
            results.append(ActionResult("move" if readable else "unreadable", readable, info=info))
        return results

    def score(self, task: dict, transcript: list[Turn], results: list[ActionResult]) -> dict[str, float]:
        final = results[-1] if results else None
        if final is not None and final.outcome == "unreadable":  # forfeited by the agent that wrote it
            return {role: 0.0 if role == final.info["agent"] else 1.0 for role in self.turn_order}
        if final is None or not final.info["finished"]:  # cut at max_turns: a draw
            return dict.fromkeys(self.turn_order, 0.5)
        return {role: outcome_reward(final.info["rewards"].get(role, 0.0)) for role in self.turn_order}


def aec_game(name: str, make: Callable[[], Any], max_turns: int, render: Callable[[Any, str], str] | None = None,
             parse: Callable[[str, Any], Any] = integer_move) -> type[AECGame]:
    """The environment class of a PettingZoo AEC game: register it (``register_environment``) before the config
    loads.

    Args:
        name: the environment's name in configs.
        make: a new game (``tictactoe_v3.env``); every call must give the same game, and ``reset(seed=...)`` must
            make its chance moves a function of the seed.
        max_turns: where an episode the game has not ended is cut (a draw).
        render: an agent's observation as its prompt; None: the observation is the text (a ``Text`` space).
        parse: a reply as the action of the agent's ``action_space``, or None when it reads none (default: its first
            integer, for a ``Discrete`` space).
    """
    agents = tuple(make().possible_agents)
    if not agents:
        raise ValueError(f"{name}: the game has no possible_agents")
    return type(f"AEC_{name}", (AECGame,), {
        "name": name, "turn_order": agents, "max_turns": max_turns, "make": staticmethod(make),
        "render": staticmethod(render or _as_text), "parse": staticmethod(parse), "__module__": __name__})


def _as_text(observation: Any, agent: str) -> str:
    if not isinstance(observation, str):
        raise ValueError(f"{agent}'s observation is a {type(observation).__name__}, not text: give aec_game a render")
    return observation
