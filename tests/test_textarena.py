"""TextArena's games as teams (environments/textarena_games.py), on the real textarena package: the game decides
whose turn it is and when an episode ends, a refused move is recorded and costs what the game's rules make it cost,
and a launch trains a three-player game with two seats on one policy (self-play) and the third on its own."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from environments.textarena_games import KuhnPoker, ThreePlayerTicTacToe, TicTacToe, textarena_game
from marl_pipeline.config import ConfigError, parse_config
from marl_pipeline.environment import Turn, register_environment
from marl_pipeline.run.events import EvaluationCommitted
from marl_pipeline.run.recipe import train
from marl_pipeline.stages.rollout import next_turn
from marl_pipeline.store import ExperienceStore
from tests.games import play

SHARES_WARM_ACTORS = True  # its launch takes the engines and trainers the module before kept (conftest)
TASK = {"id": "game-7", "seed": 7}


def test_the_game_says_who_moves_a_refused_move_is_tried_again_and_a_second_one_loses() -> None:
    env = TicTacToe(TicTacToe.Options())
    assert env.turn_order == ("player_0", "player_1")
    transcript = play(env, TASK, ["[4]", "[4]", "[0]", "[8]"])  # player_1's first [4] is taken: it moves again
    assert [turn.role for turn in transcript] == ["player_0", "player_1", "player_1", "player_0"]
    assert "Available Moves: '[1]', '[2]', '[3]', '[5]', '[6]', '[7]'" in env.render_prompt("player_1", TASK,
                                                                                                transcript)
    with pytest.raises(ValueError, match="asked for player_0's prompt, but it is player_1's move"):
        env.render_prompt("player_0", TASK, transcript)
    results = env.execute(TASK, transcript)
    assert [r.outcome for r in results] == ["move", "invalid", "move", "move"]
    assert not results[-1].info["finished"]

    # the second refused move in a row ends the game, lost by the seat that made it
    lost = play(env, TASK, ["[4]", "x", "[9]"])
    assert next_turn(env, TASK, lost) is None
    results = env.execute(TASK, lost)
    assert [r.outcome for r in results] == ["move", "invalid", "invalid"] and results[-1].info["finished"]
    assert env.score(TASK, lost, results) == {"player_0": 1.0, "player_1": 0.0}


def test_a_won_game_scores_its_outcome_and_an_unfinished_one_is_a_draw() -> None:
    env = TicTacToe(TicTacToe.Options())
    won = play(env, TASK, ["[0]", "[3]", "[1]", "[4]", "[2]"])  # player_0: the top row
    assert next_turn(env, TASK, won) is None
    results = env.execute(TASK, won)
    assert results[-1].info["rewards"] == {"0": 1.0, "1": -1.0} and "won" in results[-1].info["reason"]
    assert env.score(TASK, won, results) == {"player_0": 1.0, "player_1": 0.0}
    short = textarena_game("tictactoe_cut", "TicTacToe-v0", 2, max_turns=3)(TicTacToe.Options())
    cut = play(short, TASK, ["[0]", "[3]", "[1]"])
    assert next_turn(short, TASK, cut) is None  # cut at max_turns, the game unfinished
    assert short.score(TASK, cut, short.execute(TASK, cut)) == {"player_0": 0.5, "player_1": 0.5}


def test_refused_moves_can_earn_a_reward_of_their_own() -> None:
    env = TicTacToe(TicTacToe.Options())
    lost = play(env, TASK, ["[4]", "x", "[0]", "[0]", "[1]"])  # player_0's second [0] is taken: tried again
    results = env.execute(TASK, lost)
    assert [r.outcome for r in results] == ["move", "invalid", "move", "invalid", "move"]
    assert env.score_turns(TASK, lost, results) is None  # the outcome alone, by default
    shaped = TicTacToe(TicTacToe.Options(refused_move_reward=0.1))
    outcome = shaped.score(TASK, lost, results)
    assert shaped.score_turns(TASK, lost, results) == [outcome["player_0"], 0.1, outcome["player_1"], 0.1,
                                                       outcome["player_0"]]


def test_three_seats_move_in_turn_and_held_out_positions_grade_legal_moves() -> None:
    env = ThreePlayerTicTacToe(ThreePlayerTicTacToe.Options())
    assert [turn.role for turn in play(env, TASK, ["[0]", "[1]", "[2]", "[3]"])] == \
        ["player_0", "player_1", "player_2", "player_0"]
    cases = env.evaluation_cases("player_2", np.random.default_rng(0), 6)
    assert len(cases) == 6 and all(len(case.transcript) % 3 == 2 for case in cases)  # player_2's move next
    assert all(case.task["seed"] >= 1 << 40 for case in cases)  # seeds training never draws
    legal, taken = cases[0].label.split()[0], cases[1].transcript[0].text
    scores = env.evaluate("player_2", cases[:2], [f"I take {legal}", taken])
    assert scores == {"legal_move_rate": 0.5}


def test_a_card_game_offers_its_actions_and_scores_the_chips_after_its_hands() -> None:
    """Kuhn Poker (three hands of J, Q, K; SPIRAL's second game): its table lists the actions open now, which the
    warm-up and the held-out cases read as the board's cells are read."""
    env = KuhnPoker(KuhnPoker.Options())
    first = next_turn(env, TASK, [])
    assert env.legal_moves(_game(env, [])) == ["[check]", "[bet]"]
    assert env.legal_moves(_game(env, ["[bet]"])) == ["[fold]", "[call]"]
    bet = play(env, TASK, ["[bet]"])
    assert "Your available actions are: '[fold]', '[call]'" in env.render_prompt(next_turn(env, TASK, bet), TASK, bet)
    refused = play(env, TASK, ["[call]", "[check]"])  # no bet to call: the same seat moves again
    assert [turn.role for turn in refused] == [first, first]
    assert [r.outcome for r in env.execute(TASK, refused)] == ["invalid", "move"]
    # Each hand's opener bets and the other folds: three hands, then the chips decide.
    transcript = play(env, TASK, ["[bet]", "[fold]"] * 3)
    assert next_turn(env, TASK, transcript) is None
    results = env.execute(TASK, transcript)
    assert results[-1].info["finished"] and sum(env.score(TASK, transcript, results).values()) == 1.0
    cases = env.evaluation_cases("player_0", np.random.default_rng(0), 4)
    assert all(set(case.label.split()) in ({"[check]", "[bet]"}, {"[fold]", "[call]"}) for case in cases)
    # The game's own settings: one hand, Kuhn's original game, over TextArena's three.
    one_hand = KuhnPoker(KuhnPoker.Options(game_settings={"max_rounds": 1}))
    folded = play(one_hand, TASK, ["[bet]", "[fold]"])
    assert next_turn(one_hand, TASK, folded) is None and "out of 1 rounds" in one_hand.render_prompt(
        next_turn(one_hand, TASK, []), TASK, [])
    assert sorted(one_hand.score(TASK, folded, one_hand.execute(TASK, folded)).values()) == [0.0, 1.0]


def _game(env, moves: list[str]):
    """The TextArena game after ``moves``, as the plugin replays it."""
    return env._replay(TASK, moves)[0]


def test_a_game_that_is_not_there_needs_a_network_or_other_seats_is_refused_when_the_config_loads(tmp_path) -> None:
    def config(game: str | None = None, agents=("player_0", "player_1")) -> dict:
        return {"run": "ta", "store": str(tmp_path), "agents": {a: {"warmup": {"steps": 0}} for a in agents},
                "environment": {"name": "textarena_tictactoe", "options": {"game": game} if game else {}}}

    assert parse_config(config()).environment.name == "textarena_tictactoe"
    with pytest.raises(ConfigError, match=r"environment\.options\.game.*TextArena has no game 'TicTacToe-v9'; did "
                                          r"you mean one of \['TicTacToe-v0'"):
        parse_config(config("TicTacToe-v9"))
    with pytest.raises(ConfigError, match="TextArena's Wordle games need a network"):
        parse_config(config("Wordle-v0"))
    with pytest.raises(ConfigError, match="'ThreePlayerTicTacToe-v0' cannot seat 2 players"):
        parse_config(config("ThreePlayerTicTacToe-v0"))
    with pytest.raises(ConfigError, match=r"'TicTacToe-v0-train' does not take the settings \['rounds'\]"):
        parse_config({**config(), "environment": {"name": "textarena_tictactoe",
                                                  "options": {"game_settings": {"rounds": 1}}}})
    with pytest.raises(ConfigError, match=r"no agent plays role\(s\) \['player_1'\]"):
        parse_config(config(agents=("player_0",)))
    with pytest.raises(ValueError, match="cannot seat 3 players"):
        textarena_game("bad", "TicTacToe-v0", 3, max_turns=9)


@pytest.mark.launch
def test_a_three_player_game_trains_two_seats_on_one_policy_and_the_third_on_its_own(local_ray,
                                                                                   tmp_path: Path) -> None:
    register_environment(ThreePlayerTicTacToe)  # shipped through the entry point too; this keeps the test explicit
    small = {"warmup": {"steps": 40, "batch_size": 8}, "engine": {"max_model_len": 512},
             "algorithm": {"max_new_tokens": 4}}
    data = {"run": "arena", "store": str(tmp_path / "store"),
            "environment": {"name": "textarena_three_player_tictactoe"},
            "agents": {"player_0": {**small, "roles": ["player_0", "player_1"]}, "player_2": small},
            "pipeline": {"steps": 1, "prompts_per_micro_batch": 2, "samples_per_prompt": 4,
                         "micro_batches_per_step": 1},
            "evaluation": {"every": 1, "cases_per_agent": 6}, "ray": {"keep_actors": True}}
    config = parse_config(data)
    evaluated = {event.version: event.metrics for event in train(config) if isinstance(event, EvaluationCommitted)}
    store = ExperienceStore(config.store)
    rollouts = store.read_stage(config.run, "rollouts").to_pylist()
    results = {r["sample_id"]: r for r in store.read_stage(config.run, "environment_results").to_pylist()}
    rewards = store.read_stage(config.run, "rewards").to_pylist()
    env = ThreePlayerTicTacToe(ThreePlayerTicTacToe.Options())
    episodes: dict[tuple, list[dict]] = {}
    for row in sorted(rollouts, key=lambda r: r["turn"]):
        episodes.setdefault((row["group_id"], row["trajectory"]), []).append(row)
    assert len(episodes) == 2 * 4
    for turns in episodes.values():
        task, transcript = json.loads(turns[0]["task"]), []
        for row in turns:  # each turn was the seat the game asked for, played by that seat's agent
            assert row["role"] == next_turn(env, task, transcript)
            assert row["agent"] == ("player_2" if row["role"] == "player_2" else "player_0")
            transcript.append(Turn(row["role"], row["response_text"]))
        assert next_turn(env, task, transcript) is None  # stored whole: the game ended (or hit max_turns)
        outcomes = [results[row["sample_id"]]["outcome"] for row in turns]
        assert set(outcomes) <= {"move", "invalid"}
        scored = env.score(task, transcript, env.execute(task, transcript))  # a seat that never moved has no row
        assert {r["role"]: r["reward"] for r in rewards if (r["group_id"], r["trajectory"]) == (
            turns[0]["group_id"], turns[0]["trajectory"])} == {turn.role: scored[turn.role] for turn in transcript}
    # the warm-up taught the form of a move, not always a legal one: episodes of different lengths, some moves
    # refused, every seat moving in some
    assert {"move", "invalid"} <= {r["outcome"] for r in results.values()}
    assert len({len(turns) for turns in episodes.values()}) > 1
    assert {row["role"] for row in rollouts} == {"player_0", "player_1", "player_2"}
    assert store.policy_versions(config.run, "player_0") == [0, 1] == store.policy_versions(config.run, "player_2")
    assert sorted(evaluated) == [0, 1]
    assert {"player_0", "player_1", "player_2"} <= {key.split("/")[0] for key in evaluated[1]}
