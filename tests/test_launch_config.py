"""The train job's run config, as the launchpad gives it: the experiment from a file or inline, with overrides typed
from the experiment's pydantic models. A bad override fails before anything is written, naming the field.
(That overrides reach a training run is shown in tests/test_train_job.py, whose one small run is launched with them.)
"""

from pathlib import Path
from typing import Annotated, get_args, get_origin

import dagster as dg
import pytest
import ray
import yaml
from pydantic import BaseModel

from assets.definitions import defs
from marl_pipeline.config import ConfigError, ExperimentConfig
from resources import ExperimentResource


def _experiment(tmp_path: Path, demo_config_data: dict) -> Path:
    path = tmp_path / "experiment.yaml"
    path.write_text(yaml.safe_dump({**demo_config_data, "store": str(tmp_path / "store")}))
    return path


def _train(config: dict) -> dg.ExecuteInProcessResult:
    return defs.get_job_def("train").execute_in_process(
        run_config={"resources": {"experiment": {"config": config}}}, instance=dg.DagsterInstance.ephemeral(),
        raise_on_error=False)


def _leaf_paths(model: type[BaseModel], prefix: str = "") -> set[str]:
    """Every setting of ``model`` as a dotted path, ``*`` for the key of a mapping of models (agents)."""
    paths = set()
    for name, field in model.model_fields.items():
        kind = field.annotation
        while get_origin(kind) is Annotated:
            kind = get_args(kind)[0]
        args = [arg for arg in get_args(kind) if arg is not type(None)]
        if len(args) == 1 and get_origin(args[0]) is Annotated:  # X | None where X is annotated (an agent's own)
            kind = get_args(args[0])[0]
            args = list(get_args(kind))
        if get_origin(kind) is list:  # a list is overridden whole (agents.*.parallelism_by_length)
            paths.add(prefix + name)
            continue
        models = [arg for arg in (kind, *args) if isinstance(arg, type) and issubclass(arg, BaseModel)]
        if get_origin(kind) is dict and isinstance(args[1], type) and issubclass(args[1], BaseModel):
            paths |= _leaf_paths(args[1], f"{prefix}{name}.*.")
        elif models:
            paths |= _leaf_paths(models[0], f"{prefix}{name}.")
        else:
            paths.add(prefix + name)
    return paths


def _schema_paths(config_type, prefix: str = "") -> set[str]:
    # Kinds by name: the ConfigTypeKind enum is private Dagster API.
    if config_type.kind.name == "NONEABLE":
        config_type = config_type.inner_type
    if config_type.kind.name == "MAP" and config_type.inner_type.kind.name == "STRICT_SHAPE":
        return _schema_paths(config_type.inner_type, f"{prefix}*.")
    if config_type.kind.name != "STRICT_SHAPE":
        return {prefix.rstrip(".")}
    paths = set()
    for name, field in config_type.fields.items():
        paths |= _schema_paths(field.config_type, f"{prefix}{name}.")
    return paths


def test_every_experiment_setting_is_an_override_in_the_launchpad() -> None:
    schema = defs.get_job_def("train").run_config_schema.config_type
    experiment = schema.fields["resources"].config_type.fields["experiment"].config_type.fields["config"].config_type
    overrides = _schema_paths(experiment.fields["overrides"].config_type)
    expected = _leaf_paths(ExperimentConfig)
    assert expected <= overrides, expected - overrides
    assert {"pipeline.steps", "agents.*.trainer.lr", "every_agent.trainer.lr", "seed"} <= overrides


def test_overrides_merge_into_the_file_or_the_inline_experiment(tmp_path: Path, demo_config_data: dict) -> None:
    path = _experiment(tmp_path, demo_config_data)
    overrides = {"seed": 7, "pipeline": {"staleness": 1}, "every_agent": {"trainer": {"lr": 0.01}},
                 "agents": {"verifier": {"trainer": {"lr": 0.02}}}, "store": {"compression": "snappy"},
                 "algorithm": {"advantage": {"type": "rloo"}}}
    for source in ({"config_path": str(path)}, {"experiment": yaml.safe_load(path.read_text())}):
        config = ExperimentResource(**source, overrides=overrides).load()
        assert (config.seed, config.pipeline.staleness) == (7, 1)
        assert config.pipeline.steps == demo_config_data["pipeline"]["steps"]  # what is not overridden stays
        assert config.agents["solver"].trainer.lr == 0.01  # every agent's, then the agent's own on top
        assert config.agents["verifier"].trainer.lr == 0.02
        assert config.agents["solver"].warmup.steps == demo_config_data["agents"]["solver"]["warmup"]["steps"]
        assert (config.store.uri, config.store.compression) == (str(tmp_path / "store"), "snappy")
        assert config.algorithm.advantage.type == "rloo"  # a variant chosen by its `type`
    with pytest.raises(ConfigError, match="not both"):
        ExperimentResource(config_path=str(path), experiment=yaml.safe_load(path.read_text())).load()


def test_a_mistyped_override_is_refused_at_launch_naming_its_path(tmp_path: Path, demo_config_data: dict) -> None:
    path = str(_experiment(tmp_path, demo_config_data))
    with pytest.raises(dg.DagsterInvalidConfigError, match=r"overrides:pipeline:steps\. Value \"many\".*Int"):
        _train({"config_path": path, "overrides": {"pipeline": {"steps": "many"}}})
    unknown = r'unexpected config entry "stepz" at path root:resources:experiment:config:overrides:pipeline\.'
    with pytest.raises(dg.DagsterInvalidConfigError, match=unknown):
        _train({"config_path": path, "overrides": {"pipeline": {"stepz": 3}}})
    assert not (tmp_path / "store").exists()


@pytest.mark.parametrize(("overrides", "message"), [
    ({"pipeline": {"steps": 0}}, "pipeline.steps: Input should be greater than or equal to 1"),
    ({"pipeline": {"mode": "synchronous", "staleness": 2}}, "pipeline: Value error, mode 'synchronous'"),
    ({"agents": {"judge": {"trainer": {"lr": 0.1}}}}, "agents.judge: unknown agent"),
])
def test_a_bad_override_fails_the_run_before_anything_is_written(tmp_path: Path, demo_config_data: dict,
                                                                 overrides: dict, message: str) -> None:
    result = _train({"config_path": str(_experiment(tmp_path, demo_config_data)), "overrides": overrides})
    assert not result.success
    [failure] = [e for e in result.all_events if e.event_type == dg.DagsterEventType.RESOURCE_INIT_FAILURE]
    assert message in failure.event_specific_data.error.message  # the run's event log names the field
    assert not [e for e in result.all_events if e.is_step_start]  # no op started
    assert not (tmp_path / "store").exists() and not ray.is_initialized()
