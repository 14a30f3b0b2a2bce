"""PettingZoo AEC games as teams (environments/pettingzoo_aec.py), on the real pettingzoo package: a game written in
PettingZoo's own AEC format (it passes PettingZoo's API test, which wants array observations) is played through the
plugin hooks, its observation rendered as text, the game naming who acts and when it is over."""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import pytest
from gymnasium import spaces
from pettingzoo import AECEnv
from pettingzoo.test import api_test
from pettingzoo.utils import AgentSelector

from environments.pettingzoo_aec import aec_game
from marl_pipeline.config import parse_config
from marl_pipeline.environment import register_environment
from marl_pipeline.stages.rollout import next_turn
from tests.games import play


class Nim(AECEnv):
    """Two players take 1 to 3 stones from a pile of 5 to 9 (drawn from the seed); who takes the last one wins. Taking
    more than the pile holds, or none, loses at once. An observation is the pile's size."""

    metadata: ClassVar[dict] = {"name": "text_nim_v0", "is_parallelizable": False, "render_modes": []}

    def __init__(self) -> None:
        super().__init__()
        self.possible_agents = ["first", "second"]
        self.render_mode = None
        self.observation_spaces = {a: spaces.Box(0, 9, (1,), np.int64) for a in self.possible_agents}
        self.action_spaces = {a: spaces.Discrete(4) for a in self.possible_agents}

    def observation_space(self, agent: str) -> spaces.Space:
        return self.observation_spaces[agent]

    def action_space(self, agent: str) -> spaces.Space:
        return self.action_spaces[agent]

    def observe(self, agent: str) -> np.ndarray:
        return np.array([self.pile], dtype=np.int64)

    def reset(self, seed: int | None = None, options: dict | None = None) -> None:
        self.pile = int(np.random.default_rng(seed).integers(5, 10))
        self.agents = list(self.possible_agents)
        self.rewards = dict.fromkeys(self.agents, 0)
        self._cumulative_rewards = dict.fromkeys(self.agents, 0)
        self.terminations = dict.fromkeys(self.agents, False)
        self.truncations = dict.fromkeys(self.agents, False)
        self.infos = {agent: {} for agent in self.agents}
        self._selector = AgentSelector(self.agents)
        self.agent_selection = self._selector.reset()

    def step(self, action: int | None) -> None:
        if self.terminations[self.agent_selection] or self.truncations[self.agent_selection]:
            self._was_dead_step(action)
            return
        agent, other = self.agent_selection, next(a for a in self.agents if a != self.agent_selection)
        self.rewards = dict.fromkeys(self.agents, 0)
        if not 1 <= action <= min(3, self.pile):
            self.rewards.update({agent: -1, other: 1})
        else:
            self.pile -= action
            if self.pile == 0:
                self.rewards.update({agent: 1, other: -1})
        if self.rewards[agent]:
            self.terminations = dict.fromkeys(self.agents, True)
        self._cumulative_rewards[agent] = 0
        self._accumulate_rewards()
        self.agent_selection = self._selector.next()


def render(observation: np.ndarray, agent: str) -> str:
    return f"Pile: {observation[0]} stones. You are {agent}. Take 1, 2 or 3 stones: answer [k]."


NimGame = aec_game("text_nim", Nim, max_turns=12, render=render)
TASK = {"id": "game-3", "seed": 3}  # a pile of np.random.default_rng(3).integers(5, 10)


@pytest.mark.filterwarnings("ignore:Observation is a single number")  # advice for learning from arrays
def test_the_game_is_pettingzoos_own_format() -> None:
    api_test(Nim(), num_cycles=20)


def test_the_game_names_who_acts_and_the_taker_of_the_last_stone_wins() -> None:
    env = NimGame(NimGame.Options())
    pile = int(np.random.default_rng(3).integers(5, 10))
    assert env.turn_order == ("first", "second")
    assert env.render_prompt("first", TASK, []) == render(np.array([pile]), "first")
    assert render(np.array([pile]), "first").startswith(f"Pile: {pile} stones. You are first.")
    takes, left = [], pile
    while left:  # each takes what it can, up to 3
        takes.append(min(3, left))
        left -= takes[-1]
    transcript = play(env, TASK, [f"I take [{take}]" for take in takes])
    assert [turn.role for turn in transcript] == ["first", "second"] * (len(takes) // 2) + ["first"] * (len(takes) % 2)
    assert next_turn(env, TASK, transcript) is None
    results = env.execute(TASK, transcript)
    assert [r.outcome for r in results] == ["move"] * len(takes) and results[-1].info["finished"]
    winner = transcript[-1].role
    assert env.score(TASK, transcript, results) == {role: 1.0 if role == winner else 0.0 for role in env.turn_order}
    with pytest.raises(ValueError, match="asked for first's prompt, but second acts next"):
        env.render_prompt("first", TASK, transcript[:1])


def test_an_illegal_move_loses_by_the_games_rule_and_an_unreadable_one_forfeits() -> None:
    env = NimGame(NimGame.Options())
    illegal = play(env, TASK, ["[2]", "[0]"])  # taking none: the game's own rule ends it
    assert next_turn(env, TASK, illegal) is None
    assert env.score(TASK, illegal, env.execute(TASK, illegal)) == {"first": 1.0, "second": 0.0}
    unreadable = play(env, TASK, ["no idea"])  # no action the game could take: it never sees the reply
    assert next_turn(env, TASK, unreadable) is None
    results = env.execute(TASK, unreadable)
    assert [r.outcome for r in results] == ["unreadable"] and not results[0].success
    assert env.score(TASK, unreadable, results) == {"first": 0.0, "second": 1.0}
    assert env.score(TASK, illegal[:1], env.execute(TASK, illegal[:1])) == {"first": 0.5, "second": 0.5}  # unfinished


def test_a_config_plays_the_games_agents_as_roles(tmp_path) -> None:
    register_environment(NimGame)
    data = {"run": "nim", "store": str(tmp_path), "environment": {"name": "text_nim"},
            "agents": {"first": {"model": "smollm2-135m-instruct", "roles": ["first", "second"],
                                 "warmup": {"steps": 0}}}}
    assert parse_config(data).role_agents() == {"first": "first", "second": "first"}  # self-play
    with pytest.raises(ValueError, match="observation is a ndarray, not text: give aec_game a render"):
        game = aec_game("array_nim", Nim, max_turns=12)
        game(game.Options()).render_prompt("first", TASK, [])
