"""Each agent's own algorithm settings (``agents.<a>.algorithm`` over ``algorithm:``): parsed and checked with the
config, and read per agent by the rollout, the evaluation, the reward stage's estimator, the trainer's options,
dynamic sampling, the planner's workload and the policy card. tests/test_train_job.py launches a run with them set
from the launchpad."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from environments.math_verifier import MathOptions, MathSolverVerifier
from marl_pipeline.cluster.specs import BASE_POLICY, trainer_options
from marl_pipeline.config import ConfigError, GRPOAdvantage, RLOOAdvantage, parse_config
from marl_pipeline.planner.costs import Costs, Turn
from marl_pipeline.planner.plan import replies_capped
from marl_pipeline.run.cards import model_card
from marl_pipeline.run.provenance import agent_algorithm
from marl_pipeline.stages.evaluation import EvaluationSettings
from marl_pipeline.stages.execution import execute_micro_batch
from marl_pipeline.stages.reward import score_micro_batch
from marl_pipeline.stages.rollout import RolloutSettings
from tests.test_credit_and_actions import rollouts_of


def _config(demo_config_data: dict, tmp_path: Path, **own: dict):
    data = copy.deepcopy(demo_config_data)
    data["store"] = str(tmp_path / "store")
    data["algorithm"] = {"temperature": 0.9, "max_new_tokens": 8, "clip_eps": 0.3}
    for agent, settings in own.items():
        data["agents"][agent]["algorithm"] = settings
    return parse_config(data)


def test_an_agents_own_settings_replace_the_experiments_and_the_rest_stay(demo_config_data: dict,
                                                                          tmp_path: Path) -> None:
    config = _config(demo_config_data, tmp_path, verifier={
        "temperature": 0.5, "max_new_tokens": 2, "kl_coef": 0.05, "entropy_coef": 0.01,
        "advantage": {"type": "rloo"}, "drop_zero_advantage_groups": True, "loss_normalization": "sequence",
        "tis_cap": 2.0})
    solver, verifier = config.algorithm_of("solver"), config.algorithm_of("verifier")
    assert solver == config.algorithm  # it sets nothing: the experiment's, the same object
    assert (verifier.temperature, verifier.max_new_tokens, verifier.kl_coef, verifier.entropy_coef) == (
        0.5, 2, 0.05, 0.01)
    assert verifier.clip_eps == 0.3  # not set by the verifier: the experiment's
    assert (verifier.advantage, solver.advantage) == (RLOOAdvantage(), GRPOAdvantage())  # replaced whole
    assert config.advantages() == {"solver": GRPOAdvantage(), "verifier": RLOOAdvantage()}
    assert config.dropping_zero_advantage_groups() == {"verifier"}
    # the trainers' options, each cut from its own agent's settings
    solver_options, verifier_options = (trainer_options(config.agent_slice(a)) for a in ("solver", "verifier"))
    assert (solver_options["clip_eps"], solver_options["kl_coef"], solver_options["reference_dir"]) == (0.3, 0.0, None)
    assert (verifier_options["clip_eps"], verifier_options["kl_coef"], verifier_options["reference_dir"],
            verifier_options["entropy_coef"], verifier_options["loss_normalization"], verifier_options["tis_cap"]
            ) == (0.3, 0.05, BASE_POLICY, 0.01, "sequence", 2.0)
    # sampling at rollout and at evaluation, per agent
    rollout = RolloutSettings.from_config(config)
    assert (rollout.max_new_tokens, rollout.temperature) == ({"solver": 8, "verifier": 2},
                                                             {"solver": 0.9, "verifier": 0.5})
    request = rollout.request("verifier", "1+2=3?", seed=7)
    assert (request.max_tokens, request.temperature) == (2, 0.5)
    evaluation = EvaluationSettings.from_config(config)
    assert (evaluation.max_new_tokens, evaluation.temperature) == (rollout.max_new_tokens, rollout.temperature)
    data = config.model_dump(mode="json")
    data["evaluation"]["max_new_tokens"] = 5  # the evaluation's own length is every agent's
    assert EvaluationSettings.from_config(parse_config(data)).max_new_tokens == {"solver": 5, "verifier": 5}
    # the config as the launch record stores it (every field written, unset ones as null) reads back the same
    assert parse_config(data).algorithm_of("verifier") == verifier


@pytest.mark.parametrize(("own", "message"), [
    ({"clip_eps": 0}, r"agents\.verifier\.algorithm\.clip_eps: Input should be greater than 0"),
    ({"temprature": 0.5}, r"agents\.verifier\.algorithm\.temprature: unknown field"),
    ({"advantage": {"type": "rloo", "eps": 0.1}}, r"agents\.verifier\.algorithm\.advantage\.rloo\.eps: unknown field"),
    ({"advantage": {"type": "ppo"}}, r"agents\.verifier\.algorithm\.advantage"),
    ({"loss_normalization": "batch"}, r"agents\.verifier\.algorithm\.loss_normalization"),
])
def test_a_bad_own_setting_is_refused_at_parse_time_naming_its_place(demo_config_data: dict, tmp_path: Path,
                                                                     own: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        _config(demo_config_data, tmp_path, verifier=own)


def test_the_reward_stage_scores_each_agent_by_its_own_estimator() -> None:
    env = MathSolverVerifier(MathOptions())
    task = {"id": "q", "question": "2+3?", "answer": 5}
    # the solver's answers 5, 4, 4 (rewards 1, 0, 0); the verifier judges two of them right
    rollouts = rollouts_of(env, task, [["5", "correct", "5"], ["4", "wrong", "4"], ["4", "correct", "4"]])
    results = execute_micro_batch(env, rollouts)

    def advantages(advantage) -> dict[str, list[float]]:
        rows = score_micro_batch(env, rollouts, results, advantage=advantage, team_weight=0.0).sort_by(
            [("episode", "ascending"), ("turn", "ascending")]).to_pylist()
        return {agent: [row["advantage"] for row in rows if row["agent"] == agent] for agent in env.turn_order}

    alone = {kind: advantages(settings)
             for kind, settings in {"grpo": GRPOAdvantage(), "rloo": RLOOAdvantage()}.items()}
    mixed = advantages({"solver": GRPOAdvantage(), "verifier": RLOOAdvantage()})
    assert mixed == {"solver": alone["grpo"]["solver"], "verifier": alone["rloo"]["verifier"]}
    assert alone["grpo"]["verifier"] != alone["rloo"]["verifier"]  # the two estimators do differ here


def test_the_planner_caps_each_agents_replies_at_its_own_length(demo_config_data: dict, tmp_path: Path) -> None:
    config = _config(demo_config_data, tmp_path, verifier={"max_new_tokens": 2})
    stored = Costs(engines={}, trainers={}, environment=0.0, reward=0.0, rollout_overhead=0.0, train_overhead=0.0,
                   episodes=[[Turn("solver", 20, 7), Turn("verifier", 30, 5)],
                             [Turn("solver", 20, 3), Turn("verifier", 30, 1, 0.5)]])
    capped = replies_capped(stored, config)
    assert capped.episodes == [[Turn("solver", 20, 7), Turn("verifier", 30, 2)],
                               [Turn("solver", 20, 3), Turn("verifier", 30, 1, 0.5)]]
    assert replies_capped(stored, _config(demo_config_data, tmp_path, solver={"max_new_tokens": 64})) == stored


def test_the_policy_card_says_which_settings_the_agent_set_itself(demo_config_data: dict, tmp_path: Path) -> None:
    config = _config(demo_config_data, tmp_path, verifier={"temperature": 0.5, "advantage": {"type": "rloo"}})
    recorded = config.model_dump(mode="json")  # as the launch record keeps it
    algorithm = agent_algorithm(recorded, "verifier")
    assert algorithm == {"settings": config.algorithm_of("verifier").model_dump(mode="json"),
                         "own": ["advantage", "temperature"]}
    assert agent_algorithm(recorded, "solver") == {"settings": config.algorithm.model_dump(mode="json"), "own": []}
    card = model_card({"run": "r", "agent": "verifier", "version": 0, "base_model": None, "tokens": 0, "commit": None,
                       "launches": [], "store": "s", "steps": [], "steps_missing": [], "evaluation": None,
                       "health": None, "algorithm": algorithm, "config": recorded})
    assert "| temperature | 0.5 | the agent |" in card and "| clip_eps | 0.3 | the experiment |" in card
    assert '| advantage | {"type": "rloo"} | the agent |' in card
    # and the warnings its training raised (run/provenance.py reads them from the stored health)
    warning = "verifier may be collapsing: the same response is 1.00, 1.00, 1.00 of its responses"
    card = model_card({"run": "r", "agent": "verifier", "version": 3, "base_model": None, "tokens": 0, "commit": None,
                       "rows": 0,
                       "launches": [], "store": "s", "steps": [], "steps_missing": [], "evaluation": None,
                       "health": {"step": 2, "policy_version": 3, "top_answer_share": 1.0}, "warnings": [warning],
                       "algorithm": algorithm, "config": recorded})
    assert f"Warnings raised at that step (the `health` settings of its launch):\n\n- {warning}\n" in card


def test_each_agent_has_its_own_staleness_bound_and_the_gate_holds_each_to_it(demo_config_data: dict,
                                                                              tmp_path: Path) -> None:
    from marl_pipeline.run.queues import gate_open

    data = copy.deepcopy(demo_config_data)
    data.update(store=str(tmp_path / "store"))
    data["pipeline"].update(staleness=2)
    data["agents"]["solver"]["staleness"] = 0
    config = parse_config(data)
    assert config.staleness_bounds() == {"solver": 0, "verifier": 2}  # the verifier: pipeline.staleness
    bounds = config.staleness_bounds()
    assert gate_open({"solver": 5, "verifier": 3}, 5, bounds)  # the verifier 2 behind: within its bound
    assert not gate_open({"solver": 4, "verifier": 5}, 5, bounds)  # the solver 1 behind: not within 0
    assert not gate_open({"solver": 5, "verifier": 2}, 5, bounds)
    assert gate_open({"solver": 5, "verifier": 3}, 5, 2) and not gate_open({"solver": 5, "verifier": 3}, 5, 1)
    data["pipeline"].update(mode="synchronous", staleness=0)
    data["agents"]["solver"]["staleness"] = 1
    with pytest.raises(ConfigError, match=r"agents\.solver\.staleness: synchronous mode"):
        parse_config(data)
    data["agents"]["solver"]["staleness"] = 0  # 0 is what synchronous mode is
    assert parse_config(data).staleness_bounds() == {"solver": 0, "verifier": 0}


def test_an_agent_syncing_every_k_versions_needs_a_bound_of_k_minus_1_and_is_planned_so(demo_config_data: dict,
                                                                                          tmp_path: Path) -> None:
    """``agents.<a>.sync_every``: its engines load every k-th version (and the launch's last), so its turns lag up
    to k - 1 versions, which its staleness bound must allow; the planner's simulation loads the same versions."""
    from marl_pipeline.cluster.placement import plan_placement
    from marl_pipeline.planner.simulate import simulate
    from marl_pipeline.run.queues import sync_due
    from tests.test_planner import _costs

    assert [v for v in range(1, 8) if sync_due(v, 3, 7)] == [3, 6, 7]
    data = copy.deepcopy(demo_config_data)
    data.update(store=str(tmp_path / "store"))
    data["pipeline"].update(staleness=1, steps=7)
    data["agents"]["verifier"]["sync_every"] = 3
    with pytest.raises(ConfigError, match=r"agents\.verifier\.sync_every: 3 lets its turns be sampled up to 2 "
                                          r"versions behind, and its staleness bound is 1"):
        parse_config(data)
    data["agents"]["verifier"]["staleness"] = 2
    config = parse_config(data)
    nodes = [{"CPU": 2.0}]
    prediction = simulate(plan_placement(config, nodes), config.pipeline, _costs(), nodes, None,
                          config.staleness_bounds(), {"verifier": 3})
    assert sorted(prediction.served["verifier"]) == [0, 3, 6, 7] and sorted(prediction.served["solver"]) == [
        *range(8)]
    lags = {agent: {d.step - d.version for d in prediction.decisions if d.agent == agent}
            for agent in ("solver", "verifier")}
    assert lags == {"solver": {0, 1}, "verifier": {0, 1, 2}}
    data["pipeline"].update(mode="synchronous", staleness=0)
    data["agents"]["verifier"]["staleness"] = 0
    with pytest.raises(ConfigError, match="synchronous mode samples each step from the versions of the step before"):
        parse_config(data)


def test_the_gate_replay_waits_for_the_versions_an_agent_syncing_every_k_served() -> None:
    """A stored version its engines did not load (``served: false`` in its record, ``sync_every``) opens no gate in
    the replay: the verifier at bound 2 syncing every 3 lets step 3 go only once version 3 is served."""
    from marl_pipeline.planner.replay import _gate_times

    served = {"solver": {0: float("-inf"), 1: 1.0, 2: 2.0, 3: 3.0}, "verifier": {0: float("-inf"), 3: 3.5}}
    recorded = {"solver": {0, 1, 2, 3}, "verifier": {0, 1, 2, 3}}
    opened = _gate_times(served, recorded, [2, 3], {"solver": 0, "verifier": 2})
    assert opened == {2: 2.0, 3: 3.5}  # step 2 on the solver's version 2, step 3 on the verifier's 3
    assert _gate_times(served, {**recorded, "verifier": {0, 3}}, [3], {"solver": 0, "verifier": 2}) == {}
