"""``marl train CONFIG --set KEY=VALUE``: settings overridden as the launchpad's ``overrides`` do, validated before
anything starts, and handed to the train job's experiment resource (the real one, loaded as a run loads it)."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from assets.cli import app
from assets.cli.train import train_run_config
from marl_pipeline.config import ConfigError, dotted_overrides
from resources.experiment import ExperimentResource

DEMO = Path(__file__).resolve().parents[1] / "configs" / "demo.yaml"


def test_dotted_settings_nest_as_the_file_does_and_a_star_means_every_agent() -> None:
    overrides = dotted_overrides(["pipeline.steps=5", "seed=1", "agents.*.trainer.lr=1e-5",
                                  "agents.solver.engine.replicas=2", "environment.options.max_terms=[2, 3]"],
                                 agents=["solver", "verifier"])
    assert overrides == {"pipeline": {"steps": 5}, "seed": 1,
                         "agents": {"solver": {"trainer": {"lr": "1e-5"}, "engine": {"replicas": 2}},
                                    "verifier": {"trainer": {"lr": "1e-5"}}},
                         "environment": {"options": {"max_terms": [2, 3]}}}  # YAML 1.1 reads 1e-5 as a string
    for bad in ("pipeline.steps", "=5", "pipeline..steps=5", "pipeline.*=5", "*.steps=1"):
        with pytest.raises(ConfigError, match="--set"):
            dotted_overrides([bad], agents=["solver"])


def test_the_cli_overrides_reach_the_run_as_the_launchpads_do() -> None:
    config, experiment = train_run_config(DEMO, ["pipeline.steps=3", "seed=7", "agents.*.trainer.lr=0.002"])
    assert (config.pipeline.steps, config.seed) == (3, 7)
    assert {agent.trainer.lr for agent in config.agents.values()} == {0.002}
    loaded = ExperimentResource(**experiment).load()  # what the train job's resource gives its run
    assert loaded == config
    untouched, plain = train_run_config(DEMO, [])
    assert plain == {"config_path": str(DEMO)} and untouched.pipeline.steps != 3


def test_settings_the_file_spells_differently_are_run_config_the_train_job_takes(tmp_path: Path) -> None:
    """A store given as a URI and a float YAML reads as a string (the help's own example) pass the train job's run
    config as validated: Dagster refused both before ("must be dict", "Invalid scalar"), and `marl train` then waited
    60 s on a Ray it had stopped."""
    import dagster as dg

    from assets.definitions import defs

    store = str(tmp_path / "other")
    config, experiment = train_run_config(DEMO, [f"store={store}", "agents.*.trainer.lr=1e-5", "seed=3"])
    assert experiment["overrides"]["store"]["uri"] == store
    assert experiment["overrides"]["agents"]["solver"]["trainer"] == {"lr": 1e-5}
    run_config = {"resources": {"experiment": {"config": experiment}}}
    assert dg.validate_run_config(defs.get_job_def("train"), run_config)
    loaded = ExperimentResource(**experiment).load()
    assert loaded == config and loaded.store.uri == store and loaded.seed == 3


def test_a_bad_setting_fails_at_once_naming_it() -> None:
    runner = CliRunner()
    result = runner.invoke(app, ["train", str(DEMO), "--set", "pipeline.steps=many"])
    assert result.exit_code == 2
    assert "pipeline.steps" in result.output and "many" in result.output
    result = runner.invoke(app, ["train", str(DEMO), "--set", "pipeline.stepz=3"])
    assert result.exit_code == 2 and "stepz" in result.output
    result = runner.invoke(app, ["train", str(DEMO), "--set", "pipeline.steps"])
    assert result.exit_code == 2 and "KEY=VALUE" in result.output


def test_rays_start_notices_are_dropped_and_its_other_warnings_kept() -> None:
    """The ``ray.init`` notices that ask nothing of a ``marl`` user, filtered on Ray's own loggers."""
    import logging

    from assets.cli.output import RayStartNotices

    RayStartNotices.install()
    RayStartNotices.install()  # once per logger, however often the command runs in a process
    records = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    worker, ray_logger = logging.getLogger("ray._private.worker"), logging.getLogger("ray")
    handler = Keep()
    ray_logger.addHandler(handler)  # where both loggers' records reach Ray's own handlers
    try:
        worker.warning("SIGTERM handler is not set because current thread is not the main thread.")
        tokens = logging.getLogger("ray._private.authentication.authentication_token_setup")
        tokens.warning("Token authentication is enabled for this Ray cluster. Set RAY_AUTH_MODE=disabled to opt out.")
        tokens.warning("Generated new authentication token and saved to /root/.ray/auth_token")  # a host's first
        worker.warning("Some other warning a user should see")
    finally:
        ray_logger.removeHandler(handler)
    assert records == ["Some other warning a user should see"]
    assert sum(isinstance(f, RayStartNotices) for f in worker.filters) == 1
