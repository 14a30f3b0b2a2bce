"""Engines and trainers kept between the launches of one process (``ray.keep_actors``, cluster/warm_actors.py): the
next launch takes them and ends exactly where a launch on new actors ends, an engine given other settings rebuilt in
its process; what they cannot serve is replaced."""

from __future__ import annotations

import shutil
from pathlib import Path

import pyarrow.compute as pc
import pytest
from safetensors.torch import load_file

from marl_pipeline.cluster import warm_actors
from marl_pipeline.config import parse_config
from marl_pipeline.inference.engine import model_fingerprint
from marl_pipeline.run.recipe import train
from marl_pipeline.store import ExperienceStore
from tests.conftest import small_config_data


def _alive(ray) -> dict[int, str]:
    """The cluster's live actor processes: pid -> class."""
    actors = ray._private.state.actors(actor_state_name="ALIVE").values()
    return {actor["Pid"]: actor["ActorClassName"] for actor in actors}


def _launch(demo_config_data: dict, store: Path, **engine) -> ExperienceStore:
    data = small_config_data(demo_config_data, store, steps=2)
    for agent in data["agents"].values():
        agent["engine"].update(engine)
    config = parse_config(data)
    list(train(config))
    return ExperienceStore(config.store)


@pytest.mark.launch
def test_a_launch_on_kept_actors_ends_where_a_launch_on_new_ones_does(local_ray, demo_config_data,
                                                                     tmp_path: Path) -> None:
    first = _launch(demo_config_data, tmp_path / "first")  # new actors, kept when it ends
    assert warm_actors.idle_count() == 4  # two engines, two trainers
    started = _alive(local_ray)
    second = _launch(demo_config_data, tmp_path / "second")  # the same settings: takes all four
    assert _alive(local_ray) == started
    for agent in ("solver", "verifier"):
        for version in (0, 2):
            new, kept = (load_file(store.policy_dir("demo", agent, version) / "model.safetensors")
                         for store in (first, second))
            assert all((new[name] == kept[name]).all() for name in new), (agent, version)
    columns = ["sample_id", "response_ids", "logprobs"]
    new, kept = (store.read_stage("demo", "rollouts", columns=columns).sort_by("sample_id")
                 for store in (first, second))
    assert new.num_rows and new.equals(kept)  # every sample, and the engine's logprob of each token, the same

    # Other engine settings: the kept engines are rebuilt in their processes, the trainers taken, and the launch
    # ends where one on new actors with those settings ends.
    third = _launch(demo_config_data, tmp_path / "third", max_model_len=96)
    assert _alive(local_ray) == started
    warm_actors.stop_idle()
    fourth = _launch(demo_config_data, tmp_path / "fourth", max_model_len=96)
    assert not set(_alive(local_ray)) & set(started)
    rebuilt, new = (store.read_stage("demo", "rollouts", columns=columns).sort_by("sample_id")
                    for store in (third, fourth))
    assert rebuilt.num_rows and rebuilt.equals(new)
    assert pc.max(third.read_stage("demo", "policy_updates", columns=["step"]).column("step")).as_py() == 1


def test_an_engine_is_rebuilt_in_its_process_only_on_a_cpu_with_its_threads_and_one_rank() -> None:
    from marl_pipeline.inference.engine import RolloutEngine

    engine = object.__new__(RolloutEngine)  # the rule reads the settings it was built with, not vLLM
    engine._settings = {"threads": 1, "tensor_parallel_size": 1, "max_model_len": 128, "seed": 0}
    assert engine.rebuildable({"threads": 1, "tensor_parallel_size": 1, "max_model_len": 96, "seed": 3})
    assert not engine.rebuildable({"threads": 2, "tensor_parallel_size": 1})
    assert not engine.rebuildable({"threads": 1, "tensor_parallel_size": 2})

def test_an_engine_is_reused_only_for_the_same_model_files_besides_its_weights(tiny_model_dir: Path,
                                                                               tmp_path: Path) -> None:
    copy = Path(shutil.copytree(tiny_model_dir, tmp_path / "copy"))
    assert model_fingerprint(str(copy)) == model_fingerprint(str(tiny_model_dir))
    (copy / "model.safetensors").write_bytes(b"other weights")
    (copy / "timing.json").write_text("{}")  # the store's record of a version, not the model
    assert model_fingerprint(str(copy)) == model_fingerprint(str(tiny_model_dir))
    tokenizer = copy / "tokenizer.json"
    tokenizer.write_text(tokenizer.read_text() + " ")
    assert model_fingerprint(str(copy)) != model_fingerprint(str(tiny_model_dir))
