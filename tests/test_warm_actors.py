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
from marl_pipeline.cluster.spawn import start_engines
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

    # A recomputation's engines (an evaluation's, a cast's), all taken idle: the idle trainers stay for the next launch
    config = parse_config(small_config_data(demo_config_data, tmp_path / "second", steps=2))
    engines = start_engines(config, second, {"solver": 2, "verifier": 2})
    assert warm_actors.idle_count() == 2 and _alive(local_ray) == started
    for engine in engines.values():
        warm_actors.release(engine, keep=True)

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


class _Served:
    """An actor that remembers what it serves: the restart protocol of a kept engine without vLLM."""

    def __init__(self, what: str) -> None:
        self.what = what

    def restart(self, what: str) -> bool:
        self.what = what
        return True

    def serving(self) -> str:
        return self.what


def test_a_kept_actor_last_started_for_the_same_work_is_taken_first(local_ray) -> None:
    """Two agents' engines share a key (the same resources and threads); each next launch's engine takes the one that
    served its agent with its options, which reloads weights, not the other, which would rebuild its engine."""
    actor = local_ray.remote(num_cpus=0)(_Served)
    idle, used = warm_actors.idle_count(), warm_actors.in_use()  # the module's launches keep theirs
    first = {name: warm_actors.start(actor, "key", name, prefer=name) for name in ("solver", "verifier")}
    for handle in first.values():
        warm_actors.release(handle, keep=True)
    again = {name: warm_actors.start(actor, "key", name, prefer=name) for name in ("verifier", "solver")}
    assert {name: handle._actor_id for name, handle in again.items()} == {
        name: handle._actor_id for name, handle in first.items()}
    other = warm_actors.start(actor, "key", "reporter", prefer="reporter")  # nothing kept: a new actor
    assert other._actor_id not in {handle._actor_id for handle in first.values()}
    assert local_ray.get(other.serving.remote()) == "reporter"
    for handle in [*again.values(), other]:
        warm_actors.release(handle, keep=False)
    assert (warm_actors.idle_count(), warm_actors.in_use()) == (idle, used)


def test_a_kept_actor_is_taken_where_the_plan_gives_it_as_many_cpus_or_more(local_ray) -> None:
    """A kept actor holds the CPUs it reserved when it started. A launch whose plan gives the actor as many or more
    takes it (it holds nothing the plan did not count on); one that gives fewer does not (its other actors could wait
    for the difference)."""
    actor = local_ray.remote(num_cpus=0)(_Served)
    idle, used = warm_actors.idle_count(), warm_actors.in_use()
    kept = warm_actors.start(actor, "key", "solver", held_cpus=0.4)
    warm_actors.release(kept, keep=True)
    smaller = warm_actors.start(actor, "key", "solver", held_cpus=0.25)
    assert smaller._actor_id != kept._actor_id
    larger = warm_actors.start(actor, "key", "solver", held_cpus=0.5)
    assert larger._actor_id == kept._actor_id and warm_actors.taken_idle(larger)
    assert not warm_actors.taken_idle(smaller)
    for handle in (smaller, larger):
        warm_actors.release(handle, keep=False)
    assert (warm_actors.idle_count(), warm_actors.in_use()) == (idle, used)
