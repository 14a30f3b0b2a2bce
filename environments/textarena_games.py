"""TextArena's games as teams: each seat of a TextArena game (``textarena``, the ``environments`` extra) is a role,
and the agent playing that role plays the seat.

A TextArena game is a stateful object; this plugin's hooks are pure functions of the task and the transcript, so every
call replays the game from the task's seed and the moves so far (a move costs TextArena about 0.1 ms). The game says
whose turn it is (``next_role``: a player whose move is refused moves again, as the game's rules say) and when it
ends; an episode the game has not ended by ``max_turns`` is cut and scored a draw.

- Roles: ``player_0`` .. ``player_<n-1>``, TextArena's player ids; ``player_0`` moves first. Self-play is one policy
  in every seat (an agent whose ``roles:`` names them all), a team of separate policies one agent per seat.
- Prompts: the seat's observation as the game's wrappers render it (text; the ``-train`` variants show the rules,
  the game's messages and the current board).
- Rewards: the game's outcome, TextArena's win 1, draw 0, loss -1, mapped to 1, 0.5 and 0 (for a game of other
  payoffs, clipped to that range). A refused move is recorded as the turn's outcome ``invalid``, with the game's
  reason, and costs what the game's rules make it cost (a second refused move in a row loses a two-player game);
  ``refused_move_reward`` also gives it a reward of its own (turn-level shaping from the game's refusals).
- Held-out cases: positions reached by random legal play from seeds training never draws, one per case; an agent's
  metric is the share of its moves the game accepts (``legal_move_rate``). The warm-up shows random legal moves in
  positions of training games: the form of a move, not a good one.

``textarena_tictactoe`` (two players), ``textarena_three_player_tictactoe`` (three, a 5x5 board, four in a row) and
``textarena_kuhn_poker`` (two players, three hands of a three-card poker, one of SPIRAL's games) are registered;
:func:`textarena_game` makes the environment of another game (docs/environments.md, "Bring your own").
"""

from __future__ import annotations

import re
from typing import Any, ClassVar

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from environments.extras import extra
from environments.games import TRAINING_SEEDS, game_task, outcome_reward, sample_game_tasks
from marl_pipeline.environment import ActionResult, EvaluationCase, Turn

EVALUATION_SEEDS = TRAINING_SEEDS
"""Held-out games' seeds start here; training draws its seeds below it."""
NEEDS_NETWORK = ("Codenames", "Debate", "DontSayIt", "GuessWho", "Hangman", "LetterAuction", "ScenarioPlanning",
                 "SpellingBee", "TwentyQuestions", "WordChains", "WordLadder", "WordSearch", "Wordle")
"""TextArena 0.7.4's games that download word lists (nltk) or call a hosted model as they start: refused."""
MOVE = re.compile(r"\[\s*([^\]]*?)\s*\]")
OFFERED = re.compile(r"(?:Available Moves|available actions are):(.*)", re.IGNORECASE)
"""How TextArena's boards and tables list the moves open now (``Available Moves: '[0]', ..``, ``Your available
actions are: '[check]', '[bet]'``)."""


def _textarena():
    return extra("textarena", "TextArena games")


def _check_game(game: str, players: int, settings: dict[str, Any] | None = None) -> str:
    """``game`` if TextArena has it, it fits ``players`` seats with these ``settings`` and it plays offline; else why
    not."""
    registry = _textarena().envs.registration.ENV_REGISTRY
    if game not in registry:
        close = sorted(name for name in registry if name.lower().startswith(game.split("-")[0].lower()))[:5]
        raise ValueError(f"TextArena has no game {game!r}" + (f"; did you mean one of {close}?" if close else ""))
    entry = str(registry[game].entry_point)
    if family := next((name for name in NEEDS_NETWORK if f"envs.{name}." in entry), None):
        raise ValueError(f"TextArena's {family} games need a network as they start (word lists or a hosted "
                         f"model); this cluster plays offline, so {game!r} cannot be used")
    try:
        _new_game(game, players, 0, settings)
    except TypeError as error:
        raise ValueError(f"{game!r} does not take the settings {sorted(settings or {})}: {error}") from None
    except (AssertionError, ValueError) as error:
        raise ValueError(f"{game!r} cannot seat {players} players: {error}") from None
    return game


def _observation_text(observation: Any) -> str:
    """A seat's observation as text: as the game's wrappers render it, or a ``-raw`` variant's messages joined."""
    return observation if isinstance(observation, str) else "\n".join(str(part[1]) for part in observation)


def _new_game(game: str, players: int, seed: int, settings: dict[str, Any] | None = None):
    env = _textarena().make(game, **(settings or {}))
    env.reset(num_players=players, seed=seed)
    return env


class TextArenaOptions(BaseModel):
    """``environment.options`` of a TextArena game."""

    model_config = ConfigDict(extra="forbid")

    game: str | None = None
    """TextArena's id of the game or one of its variants (``TicTacToe-v0-train``); None: the environment's own."""
    evaluation_moves: int = 4
    """The most random legal moves played before a held-out case's position (from 0)."""
    game_settings: dict[str, Any] = {}
    """The game's own settings, as TextArena's game takes them (Kuhn Poker's ``max_rounds``), over its registered
    ones; refused when the config loads if the game does not take them."""
    refused_move_reward: float | None = Field(None, ge=0, le=1)
    """Turn-level shaping from the game's own refusals: a refused move's reward is this, the mover's other moves
    earn the game's outcome (``score_turns``: advantages relative per group, agent and turn). None: every move of a
    seat earns the outcome alone."""


class TextArenaGame:
    """The environment of one TextArena game: subclass it, or call :func:`textarena_game`."""

    name: ClassVar[str]
    game: ClassVar[str]
    """TextArena's id of the game this environment plays unless ``environment.options.game`` names a variant."""
    players: ClassVar[int]
    turn_order: ClassVar[tuple[str, ...]]
    """The seats' roles, in seat order (the game decides who moves: ``next_role``)."""
    max_turns: ClassVar[int]
    Options: ClassVar[type[BaseModel]] = TextArenaOptions

    def __init__(self, options: TextArenaOptions) -> None:
        self.options = options
        self.game_id = _check_game(options.game or self.game, self.players, options.game_settings)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.turn_order = tuple(f"player_{seat}" for seat in range(cls.players))

        class Options(TextArenaOptions):
            @field_validator("game")
            @classmethod
            def playable(cls_, game: str | None) -> str | None:
                return game if game is None else _check_game(game, cls.players)

            @model_validator(mode="after")
            def takes_settings(self) -> TextArenaOptions:
                if self.game_settings:
                    _check_game(self.game or cls.game, cls.players, self.game_settings)
                return self

        cls.Options = Options

    # -- the game, replayed ---------------------------------------------------------------------------------------

    def _replay(self, task: dict, moves: list[str]) -> tuple[Any, list[dict]]:
        """The game after ``moves``, and per move: the seat that made it and whether the game refused it."""
        env = _new_game(self.game_id, self.players, int(task["seed"]), self.options.game_settings)
        played = []
        for move in moves:
            state = env.state
            seat, errors = state.current_player_id, getattr(state, "error_count", 0)
            env.step(move)
            refused = getattr(state, "error_count", 0) > errors or (
                state.done and bool(state.game_info.get(seat, {}).get("invalid_move")))
            played.append({"seat": seat, "invalid": refused})
            if state.done:
                break
        return env, played

    def sample_tasks(self, rng: np.random.Generator, count: int) -> list[dict]:
        return sample_game_tasks(rng, count)

    def next_role(self, task: dict, transcript: list[Turn]) -> str | None:
        env, _ = self._replay(task, [turn.text for turn in transcript])
        return None if env.state.done else f"player_{env.state.current_player_id}"

    def render_prompt(self, role: str, task: dict, transcript: list[Turn]) -> str:
        env, _ = self._replay(task, [turn.text for turn in transcript])
        seat, observation = env.get_observation()
        if f"player_{seat}" != role:
            raise ValueError(f"{self.game_id}: asked for {role}'s prompt, but it is player_{seat}'s move")
        return _observation_text(observation)

    def execute(self, task: dict, transcript: list[Turn]) -> list[ActionResult]:
        env, played = self._replay(task, [turn.text for turn in transcript])
        state = env.state
        results = []
        for index, move in enumerate(played):
            last = index == len(played) - 1
            outcome = "invalid" if move["invalid"] else "move"
            info: dict[str, Any] = {"seat": move["seat"]}
            if last:
                info["finished"] = bool(state.done)
                info["rewards"] = {str(seat): float(r) for seat, r in (state.rewards or {}).items()}
                info["reason"] = str(state.game_info.get(move["seat"], {}).get("reason")
                                     or getattr(state, "info", {}).get("reason", ""))
            results.append(ActionResult(outcome, not move["invalid"], info=info))
        return results

    def score(self, task: dict, transcript: list[Turn], results: list[ActionResult]) -> dict[str, float]:
        final = results[-1].info if results else {}
        rewards = final.get("rewards") if final.get("finished") else None
        if not rewards:  # cut at max_turns before the game ended: a draw
            return dict.fromkeys(self.turn_order, 0.5)
        return {f"player_{seat}": outcome_reward(rewards.get(str(seat), 0.0)) for seat in range(self.players)}

    def score_turns(self, task: dict, transcript: list[Turn], results: list[ActionResult]) -> list[float] | None:
        if self.options.refused_move_reward is None:
            return None
        outcome = self.score(task, transcript, results)
        return [self.options.refused_move_reward if result.outcome == "invalid" else outcome[turn.role]
                for turn, result in zip(transcript, results)]

    # -- the built-in model and held-out cases ----------------------------------------------------------------------

    def _random_position(self, rng: np.random.Generator, seed: int, moves: int) -> tuple[list[Turn], Any]:
        """A position after up to ``moves`` random legal moves (each a cell or word the board offers)."""
        transcript: list[Turn] = []
        env = _new_game(self.game_id, self.players, seed, self.options.game_settings)
        for _ in range(moves):
            legal = self.legal_moves(env)
            if env.state.done or not legal:
                break
            move = legal[int(rng.integers(len(legal)))]
            transcript.append(Turn(f"player_{env.state.current_player_id}", move))
            env.step(move)
        if env.state.done:  # the last move ended the game: the position before it
            transcript = transcript[:-1]
            env, _ = self._replay({"seed": seed}, [turn.text for turn in transcript])
        return transcript, env

    @staticmethod
    def legal_moves(env: Any) -> list[str]:
        """The moves the game's current observation offers (``[4]``, ``[bet]``): the last list of them it shows
        (``OFFERED``), the plugin's one reading of a TextArena observation."""
        offered = OFFERED.findall(_observation_text(env.get_observation()[1]))
        return [f"[{move}]" for move in MOVE.findall(offered[-1])] if offered else []

    def text_corpus(self, rng: np.random.Generator, count: int) -> list[str]:
        corpus = []
        for _ in range(count):
            seed = int(rng.integers(0, TRAINING_SEEDS))
            transcript, env = self._random_position(rng, seed, int(rng.integers(0, 9)))
            legal = self.legal_moves(env) or ["[0]"]
            corpus.append(self.render_prompt(f"player_{env.state.current_player_id}", {"seed": seed}, transcript)
                          + " " + legal[int(rng.integers(len(legal)))])
        return corpus

    def _positions(self, role: str, rng: np.random.Generator, count: int, seeds: int) -> list[tuple[dict, list, Any]]:
        """``count`` positions where ``role`` moves next, from games of seeds ``seeds`` .. ``seeds + 2**40``."""
        found = []
        while len(found) < count:
            seed = seeds + int(rng.integers(0, TRAINING_SEEDS))
            transcript, env = self._random_position(rng, seed, int(rng.integers(0, self.options.evaluation_moves + 1)))
            if f"player_{env.state.current_player_id}" == role:
                found.append((game_task(seed), transcript, env))
        return found

    def warmup_examples(self, role: str, rng: np.random.Generator, count: int) -> list[tuple[str, str]]:
        """A legal move, drawn at random, in positions of training games: the move's form, not a good move."""
        examples = []
        for task, transcript, env in self._positions(role, rng, count, 0):
            legal = self.legal_moves(env)
            examples.append((self.render_prompt(role, task, transcript), legal[int(rng.integers(len(legal)))]))
        return examples

    def evaluation_cases(self, role: str, rng: np.random.Generator, count: int) -> list[EvaluationCase]:
        return [EvaluationCase(task, transcript, " ".join(self.legal_moves(env)))
                for task, transcript, env in self._positions(role, rng, count, EVALUATION_SEEDS)]

    def evaluate(self, role: str, cases: list[EvaluationCase], responses: list[str]) -> dict[str, float]:
        legal = [self.answer_of(role, response) in case.label.split() for case, response in zip(cases, responses)]
        return {"legal_move_rate": float(np.mean(legal)) if legal else 0.0}

    def answer_of(self, role: str, response: str) -> str:
        match = MOVE.search(response)
        return f"[{match.group(1)}]" if match else response.strip()[:16]


def textarena_game(name: str, game: str, players: int, max_turns: int) -> type[TextArenaGame]:
    """The environment class of a TextArena game: register it (``register_environment``) before the config loads.

    Args:
        name: the environment's name in configs.
        game: TextArena's id (``TicTacToe-v0``); it must seat ``players`` and play offline.
        players: the seats, one role each (``player_0`` ..).
        max_turns: where an episode the game has not ended is cut (a draw), refused moves included.
    """
    _check_game(game, players)
    return type(f"TextArena_{name}", (TextArenaGame,), {"name": name, "game": game, "players": players,
                                                        "max_turns": max_turns, "__module__": __name__})


class TicTacToe(TextArenaGame):
    """TextArena's Tic Tac Toe: 9 cells, 9 moves at most, each seat allowed one refused move in a row."""

    name = "textarena_tictactoe"
    game = "TicTacToe-v0-train"
    players = 2
    max_turns = 18


class ThreePlayerTicTacToe(TextArenaGame):
    """TextArena's three-player Tic Tac Toe: a 5x5 board, four in a row wins."""

    name = "textarena_three_player_tictactoe"
    game = "ThreePlayerTicTacToe-v0-train"
    players = 3
    max_turns = 40


class KuhnPoker(TextArenaGame):
    """TextArena's Kuhn Poker: a deck of J, Q and K, one card each, check, bet, call or fold; three hands, the player
    with more chips after them wins. A hand takes at most three moves."""

    name = "textarena_kuhn_poker"
    game = "KuhnPoker-v0-train"
    players = 2
    max_turns = 18
