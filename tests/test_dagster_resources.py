"""The Definitions' resources on a real Dagster instance and a real Ray: where Ray runs comes from the
experiment's YAML on every path, and a recomputed environment partition runs its actions on the action pool."""

from __future__ import annotations

import json
import os
from pathlib import Path

import dagster as dg
import pytest
import ray
import yaml

from assets.definitions import defs
from assets.partitions import add_planned_stage_partitions, stage_partition
from assets.stages import environment_results
from marl_pipeline.environment import register_environment
from marl_pipeline.store import ExperienceStore, MicroBatchKey
from tests.stored_run import WhereActionsRun, write_run


def _experiment(tmp_path: Path, demo_config_data: dict, **changes) -> Path:
    path = tmp_path / "experiment.yaml"
    path.write_text(yaml.safe_dump({**demo_config_data, "store": str(tmp_path / "store"), **changes}))
    return path


def _ray_of_definitions(config_path: Path, ray_config: dict | None = None):
    """The Definitions' own resources, configured as `dagster dev`'s launchpad or the CLI's run config does."""
    return dg.build_resources(defs.resources, resource_config={
        "experiment": {"config": {"config_path": str(config_path)}}, "ray": {"config": ray_config or {}}})


def test_ray_address_comes_from_the_experiment(tmp_path: Path, demo_config_data: dict) -> None:
    # Only resolve, never connect: no cluster listens at this address.
    unconnected = {"lifecycle": {"connect": False}}
    with _ray_of_definitions(_experiment(tmp_path, demo_config_data, ray={"address": "ray://head:10001"}),
                             unconnected) as resources:
        assert resources.ray.ray_address == "ray://head:10001"
        assert "num_cpus" not in resources.ray.ray_init_options  # ray.init refuses it for an existing cluster
    with _ray_of_definitions(_experiment(tmp_path, demo_config_data), unconnected) as resources:
        assert resources.ray.ray_address is None
    with _ray_of_definitions(_experiment(tmp_path, demo_config_data, ray={"address": "ray://head:10001"}),
                             {**unconnected, "address": "auto"}) as resources:
        assert resources.ray.ray_address == "auto"  # the resource's own field wins over the YAML


@pytest.mark.launch
def test_recomputed_environment_partition_runs_its_actions_on_the_pool(tmp_path: Path,
                                                                      demo_config_data: dict) -> None:
    register_environment(WhereActionsRun)
    store = ExperienceStore(tmp_path / "store")
    write_run(store, run="where")
    without_evaluation = {name: value for name, value in demo_config_data.items() if name != "evaluation"}
    config_path = _experiment(tmp_path, without_evaluation, run="where", environment={
        "name": WhereActionsRun.name, "pool": {"min_workers": 1, "max_workers": 1, "num_cpus": 0}}, ray={"num_cpus": 1})
    instance = dg.DagsterInstance.ephemeral()
    add_planned_stage_partitions(instance, "where", 1, 1, micro_batches=1)
    key = MicroBatchKey("where", 1, 0)
    stored = store.read("environment_results", key)
    # As the UI materializes one partition: the Definitions' resources, configured by run config only.
    result = dg.materialize([environment_results], partition_key=stage_partition("where", 1, 0),
                            instance=instance, resources=defs.resources,
                            run_config={"resources": {"experiment": {"config": {"config_path": str(config_path)}}}})
    assert result.success
    recomputed = store.read("environment_results", key).to_pylist()
    assert len(recomputed) == stored.num_rows and {row["status"] for row in recomputed} == {"ok"}
    where = [json.loads(row["info"]) for row in recomputed]
    assert os.getpid() not in {info["pid"] for info in where}  # every action ran on a pool worker, none in the step
    assert {info["cluster_cpus"] for info in where} == {1}  # on the embedded Ray sized by the YAML's ray.num_cpus
    assert not ray.is_initialized()  # that Ray lived for the step only
