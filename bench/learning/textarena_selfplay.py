"""Benchmark: a policy trained against a frozen version 0 at a two-player TextArena game wins more often than version
0 does against the same opponent (issue 74.1, BENCHMARKS ``textarena-selfplay``).

Per seed, one ``marl train`` (bench/learning/seeds.py) of the game (``--environment``: ``textarena_kuhn_poker``,
``textarena_tictactoe``) on the built-in tiny model, its whole context (1,024 tokens, which three hands of Kuhn Poker
with refused moves need): ``player_0`` learns (lr 5e-4; 1e-3 let a seed collapse onto replies the game cannot read),
``player_1`` is held at its version 0 (``trainer.lr: 0``); a refused move earns 0 at its own turn
(``refused_move_reward``), the other moves the game's outcome. Then 200 held-out games (seeds training never draws),
sampled at temperature 1 with the same request seeds in both arms, ``player_1`` at version 0 throughout:

- ``trained``: ``player_0`` at its last version;
- ``version 0``: ``player_0`` at its version 0.

Reported per arm: ``player_0``'s mean outcome (win 1, draw 0.5, loss 0), its wins, losses, the share of its moves the
game refused, and the share of games cut where the conversation outgrew the engine's context (a draw, as the game
scores an unfinished one); mean and minimum over the seeds::

    .venv/bin/python -m bench.learning.textarena_selfplay --environment textarena_kuhn_poker --seeds 0 1 2 \
        --out /tmp/textarena_selfplay.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
from pathlib import Path

import numpy as np

from bench.learning.seeds import train
from bench.pipeline.bound import override

CONFIG = {
    # A refused move earns 0 at its own turn (the game's refusals as turn-level shaping): with the outcome alone,
    # Tic Tac Toe's seed 0 ended where it began (0.4775 against version 0's 0.48, 2026-12-06).
    "run": "frozen_opponent", "environment": {"name": "textarena_kuhn_poker", "options": {"refused_move_reward": 0.0}},
    "agents": {
        "player_0": {"model": "builtin:tiny", "warmup": {"steps": 60}, "engine": {"max_model_len": 1024},
                     "trainer": {"lr": 5e-4}, "algorithm": {"max_new_tokens": 4}},
        "player_1": {"model": "builtin:tiny", "warmup": {"steps": 60}, "engine": {"max_model_len": 1024},
                     "trainer": {"lr": 0.0}, "algorithm": {"max_new_tokens": 4}},
    },
    "pipeline": {"steps": 60, "prompts_per_micro_batch": 8, "samples_per_prompt": 4, "micro_batches_per_step": 2},
}


def play(env, engines: dict, tasks: list[dict], seed: int, max_new_tokens: int) -> list[dict]:
    """Each game of ``tasks`` played to its end by the engines of the roles (the game naming who moves), every
    request seeded by (``seed``, turn, game); per game ``player_0``'s outcome, its refused moves, and whether the game
    was cut where its conversation outgrew the engine's context (scored as the game scores an unfinished one: a
    draw)."""
    import ray

    from marl_pipeline.environment import Turn
    from marl_pipeline.inference.engine import GenerationRequest, PromptTooLong
    from marl_pipeline.stages.rollout import next_turn

    transcripts: list[list[Turn]] = [[] for _ in tasks]
    cut: set[int] = set()
    for turn in range(env.max_turns):
        seeds = np.random.SeedSequence([seed, turn]).generate_state(len(tasks))
        moving: dict[str, list[int]] = {}
        for game, task in enumerate(tasks):
            if (len(transcripts[game]) == turn and game not in cut
                    and (role := next_turn(env, task, transcripts[game])) is not None):
                moving.setdefault(role, []).append(game)
        for role, games in moving.items():
            batch = [(str(g), GenerationRequest(env.render_prompt(role, tasks[g], transcripts[g]), int(seeds[g]),
                                                max_new_tokens, 1.0)) for g in games]
            stream = engines[role].generate_stream.options(num_returns="streaming").remote(batch)
            for game, sampled in (item for chunk in stream for item in ray.get(chunk)):
                if isinstance(sampled, PromptTooLong):
                    cut.add(int(game))
                elif isinstance(sampled, BaseException):
                    raise sampled
                else:
                    transcripts[int(game)].append(Turn(role, sampled.completion.text))
    outcomes = []
    for game, (task, transcript) in enumerate(zip(tasks, transcripts)):
        results = env.execute(task, transcript)
        own = [result for turn, result in zip(transcript, results) if turn.role == "player_0"]
        outcomes.append({"outcome": env.score(task, transcript, results)["player_0"], "cut": game in cut,
                         "refused": sum(result.outcome == "invalid" for result in own), "moves": len(own)})
    return outcomes


def arm_figures(outcomes: list[dict]) -> dict[str, float]:
    return {"mean_outcome": statistics.fmean(o["outcome"] for o in outcomes),
            "wins": statistics.fmean(o["outcome"] == 1.0 for o in outcomes),
            "losses": statistics.fmean(o["outcome"] == 0.0 for o in outcomes),
            "cut": statistics.fmean(o["cut"] for o in outcomes),
            "refused_moves": sum(o["refused"] for o in outcomes) / max(1, sum(o["moves"] for o in outcomes))}


def held_out_games(config: dict, store: Path, versions: dict[str, int], games: int, seed: int) -> dict[str, float]:
    """``player_0`` at ``versions["player_0"]`` against ``player_1`` at ``versions["player_1"]``, over ``games`` of
    the game ``config`` (the run's config as trained: its environment, run and each seat's context and reply
    length)."""
    import ray

    from environments.games import TRAINING_SEEDS, game_task
    from environments.textarena_games import EVALUATION_SEEDS
    from marl_pipeline.cluster.spawn import engine_actor
    from marl_pipeline.config import EngineConfig
    from marl_pipeline.environment import build_environment
    from marl_pipeline.inference.async_engine import AsyncRolloutEngine
    from marl_pipeline.store import ExperienceStore

    env = build_environment(config["environment"]["name"], config["environment"]["options"])
    experience, agents = ExperienceStore(str(store)), config["agents"]
    engines = {role: engine_actor(EngineConfig(), actor_class=AsyncRolloutEngine).remote(
        str(experience.require_policy(config["run"], role, version)), version, gpu_memory_utilization=0.08,
        max_model_len=agents[role]["engine"]["max_model_len"], dtype="float32", seed=0)
        for role, version in versions.items()}
    try:
        rng = np.random.default_rng([seed, 74])
        tasks = [game_task(s) for s in EVALUATION_SEEDS + rng.integers(0, TRAINING_SEEDS, games)]
        return arm_figures(play(env, engines, tasks, seed, agents["player_0"]["algorithm"]["max_new_tokens"]))
    finally:
        for engine in engines.values():
            ray.kill(engine)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--environment", default=CONFIG["environment"]["name"],
                        help="a two-player TextArena game's environment (environments/textarena_games.py)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=CONFIG["pipeline"]["steps"])
    parser.add_argument("--games", type=int, default=200)
    parser.add_argument("--work", type=Path, default=Path("/tmp/marl-bench-textarena"))
    parser.add_argument("--out", type=Path)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a setting of CONFIG (YAML value), e.g. agents.player_0.algorithm.kl_coef=0.1")
    args = parser.parse_args()
    import copy

    import ray

    shutil.rmtree(args.work, ignore_errors=True)
    data = copy.deepcopy({**CONFIG, "pipeline": {**CONFIG["pipeline"], "steps": args.steps}})
    data["environment"]["name"] = args.environment
    for setting in args.set:
        override(data, setting)
    figures: dict[str, dict[int, dict[str, float]]] = {"trained": {}, "version 0": {}}
    for seed in args.seeds:
        train(data, seed, args.work)
        store = args.work / f"seed{seed}" / "store"
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        try:
            for arm, version in (("trained", args.steps), ("version 0", 0)):
                figures[arm][seed] = held_out_games(data, store, {"player_0": version, "player_1": 0}, args.games,
                                                    seed)
                print(f"seed {seed} {arm}: {figures[arm][seed]}", flush=True)
        finally:
            ray.shutdown()
    summary = {arm: {name: {"mean": statistics.fmean(f[name] for f in by_seed.values()),
                            "min": min(f[name] for f in by_seed.values())} for name in next(iter(by_seed.values()))}
               for arm, by_seed in figures.items()}
    print(json.dumps(summary, indent=1))
    if args.out:
        args.out.write_text(json.dumps({"environment": args.environment, "seeds": figures, "summary": summary,
                                        "steps": args.steps,
                                        "games": args.games}, indent=1))


if __name__ == "__main__":
    main()
