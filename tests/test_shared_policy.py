"""One policy playing several roles (``agents.<a>.roles``), AT-GRPO's shared-policy baseline: its config, its
advantages per role, and a launch on real Ray, vLLM and torch that trains it and exports it (tests/test_orchestrator.py
kills and resumes one)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pytest

from environments.arithmetic import ArithmeticCheck, ArithmeticOptions
from marl_pipeline.config import ConfigError, parse_config
from marl_pipeline.config.algorithm import AgentNormalizedAdvantage, GRPOAdvantage
from marl_pipeline.run.casts import parse_cast, standard_casts
from marl_pipeline.run.recipe import train
from marl_pipeline.stages.execution import execute_micro_batch
from marl_pipeline.stages.reward import score_micro_batch
from marl_pipeline.store import ExperienceStore, MicroBatchKey
from tests.conftest import small_config_data
from tests.test_credit_and_actions import rollouts_of

ROLES = ["solver", "verifier"]
SHARES_WARM_ACTORS = True  # its launches take the engines and trainers the module before kept (conftest)


def _shared(demo_config_data: dict, store: Path, **pipeline) -> dict:
    """The small demo with one agent, ``team``, playing both roles with the solver's settings."""
    data = small_config_data(demo_config_data, store, **pipeline)
    data["agents"] = {"team": {**data["agents"]["solver"], "roles": ROLES}}
    data["evaluation"] = {"every": 2, "cases_per_agent": 8, "team_samples": 2}
    return data


def test_each_role_is_played_by_one_agent_and_errors_name_the_setting(demo_config_data: dict,
                                                                       tmp_path: Path) -> None:
    data = _shared(demo_config_data, tmp_path / "store")
    config = parse_config(data)
    assert config.role_agents() == {"solver": "team", "verifier": "team"} and config.roles_played("team") == ROLES
    solver = {name: value for name, value in data["agents"]["team"].items() if name != "roles"}
    for agents, message in (
            ({"team": {**solver, "roles": ["solver"]}}, r"no agent plays role\(s\) \['verifier'\]"),
            ({"team": {**solver, "roles": ROLES}, "verifier": solver}, r"agents: Value error, agents \['team', "
                                                                       r"'verifier'\] all play role 'verifier'"),
            ({"team": {**solver, "roles": [*ROLES, "judge"]}}, r"agents.team.roles: unknown role 'judge'"),
            ({"solver": {**solver, "roles": ["verifier"]}, "other": solver}, r"agents.solver.roles: \['verifier'\] "
                                                                             r"leaves out the role named as the agent"),
            ({"team": {**solver, "roles": ["solver", "solver"]}}, "names a role twice"),
            ({"team": {**solver, "roles": ROLES, "turn_adapters": {"a": [0]}}}, "an agent playing several roles")):
        with pytest.raises(ConfigError, match=message):
            parse_config({**data, "agents": agents})
    # casts: the shared policy's roles take one policy; nothing to swap
    players = config.role_agents()
    assert [cast.name for cast in standard_casts(players, 4)] == ["trained", "team@0"]
    with pytest.raises(ValueError, match="share agent 'team'"):
        parse_cast("solver=team@4,verifier=team@0", players)


def test_a_shared_policys_roles_are_compared_within_their_own_role() -> None:
    """Both roles' rows are the agent's, yet each row's advantage is against its own role's episodes of the group:
    the same advantages as two agents of one role each get."""
    env = ArithmeticCheck(ArithmeticOptions(decoy_share=0, right_share=0))
    task = {"id": "1+2", "a": 1, "b": 2}
    episodes = [["3", "yes"], ["3", "no"], ["3", "no"], ["5", "no"]]  # rewards of unlike spread per role
    apart = rollouts_of(env, task, episodes)
    shared = apart.set_column(apart.column_names.index("agent"), apart.schema.field("agent"),
                              pa.array(["team"] * apart.num_rows, apart.schema.field("agent").type))

    def advantages(rollouts, estimator):
        scored = score_micro_batch(env, rollouts, execute_micro_batch(env, rollouts), advantage=estimator,
                                   team_weight=0.0).sort_by([("sample_id", "ascending")])
        return scored.column("advantage").to_pylist(), set(scored.column("agent").to_pylist())

    for estimator in (GRPOAdvantage(), AgentNormalizedAdvantage()):  # the second scales by each role's own spread
        (separate, agents), (together, shared_agents) = advantages(apart, estimator), advantages(shared, estimator)
        assert together == pytest.approx(separate) and agents == set(ROLES) and shared_agents == {"team"}
        assert any(value != 0 for value in together)


@pytest.mark.launch
def test_a_shared_policy_trains_both_roles_and_exports_one_policy(
        local_ray, demo_config_data: dict, tmp_path: Path) -> None:
    steps, micro_batches = 2, 2
    data = _shared(demo_config_data, tmp_path / "store", steps=steps, micro_batches_per_step=micro_batches)
    list(train(parse_config(data)))
    store = ExperienceStore(data["store"])
    # One engine and one trainer: one version line, both roles' turns in the agent's rows, sampled by its engine
    assert store.checkpoints.agents("demo") == ["team"] and store.policy_versions("demo", "team") == [0, 1, 2]
    rollouts = store.read_stage("demo", "rollouts", columns=["agent", "role", "engine", "policy_version", "step",
                                                              "status"])
    assert set(rollouts.column("agent").to_pylist()) == {"team"}
    assert sorted(set(rollouts.column("role").to_pylist())) == ROLES
    assert {engine.split("/")[0] for engine in rollouts.column("engine").to_pylist()} == {"team"}
    assert all(row["policy_version"] == row["step"] for row in rollouts.to_pylist())  # staleness 0, one line
    updates = store.read_stage("demo", "policy_updates", columns=["agent", "rows"]).to_pylist()
    assert {row["agent"] for row in updates} == {"team"}
    trained = sum(status == "ok" for status in rollouts.column("status").to_pylist())
    assert sum(row["rows"] for row in updates) == trained > rollouts.num_rows / 2  # the trainer read both roles' rows
    # each role evaluated on its own held-out cases with the one policy, and the team as a team
    evaluations = store.read("evaluations", MicroBatchKey("demo", 2, 0), columns=["agent", "metrics"])
    assert sorted(set(evaluations.column("agent").to_pylist())) == ["solver", "team", "verifier"]

    # exported as one policy whose card names the roles it plays and each role's evaluation
    from typer.testing import CliRunner

    from assets.cli import app

    out = tmp_path / "release"
    result = CliRunner().invoke(app, ["export", str(store.root), "--run", "demo", "--agent", "team", "--out", str(out)])
    assert result.exit_code == 0, result.output
    provenance = json.loads((out / "provenance.json").read_text())
    assert provenance["roles"] == ROLES and set(provenance["evaluation"]["roles"]) == set(ROLES)
    card = (out / "README.md").read_text()
    assert "one policy playing roles 'solver', 'verifier'" in card
    assert "| verifier | balanced_accuracy |" in card and "| solver | accuracy |" in card
