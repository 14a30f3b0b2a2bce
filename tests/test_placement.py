"""Placement: a run the cluster cannot hold fails at once with the arithmetic; defaults are fitted to the machine."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from examples.relay_plugin.relay_plugin import RelayGame
from marl_pipeline.cluster.placement import PlacementError, plan_placement
from marl_pipeline.config import parse_config
from marl_pipeline.environment import ActionResult, Task, Turn, register_environment


@register_environment
class RelayOfThree(RelayGame):
    """docs_relay with a middle agent: sender -> relay -> receiver (the three-agent case that used to hang)."""

    name = "relay_of_three"
    turn_order = ("sender", "relay", "receiver")

    def render_prompt(self, role: str, task: Task, transcript: list[Turn]) -> str:
        if role == "sender":
            return f"say {task['colour']}:"
        return f"heard {transcript[-1].text.strip()[:20]}:"

    def execute(self, task, transcript):
        hit = transcript[2].text.strip() == task["colour"]
        return [ActionResult("sent", True), ActionResult("passed", True), ActionResult("match" if hit else "miss", hit)]

    def score(self, task, transcript, results):
        right = float(transcript[2].text.strip() == task["colour"])
        return {"sender": right, "relay": right, "receiver": right}

    def warmup_examples(self, role, rng, count):
        tasks = self.sample_tasks(rng, count)
        if role == "sender":
            return [(self.render_prompt("sender", t, []), t["colour"]) for t in tasks]
        return [(f"heard {t['colour']}:", t["colour"]) for t in tasks]


def _config(tmp_path: Path, overrides: dict[str, dict] | None = None, ray: dict | None = None,
            **agent_overrides) -> object:
    """The trio's config: ``agent_overrides`` for every agent, ``overrides`` per agent (what is set is explicit)."""
    agents = {role: {"warmup": {"steps": 20}, **agent_overrides, **(overrides or {}).get(role, {})}
              for role in RelayOfThree.turn_order}
    return parse_config({
        "run": "trio", "store": str(tmp_path / "store"), "environment": {"name": "relay_of_three"}, "agents": agents,
        "pipeline": {"steps": 1, "prompts_per_micro_batch": 2, "samples_per_prompt": 2, "micro_batches_per_step": 1},
        "ray": ray or {},
    })


TWO_CPUS = [{"CPU": 2.0}]


def test_explicit_requests_that_do_not_fit_fail_with_the_arithmetic(tmp_path: Path) -> None:
    # three resident trainers asked for: no swapping to fall back on
    config = _config(tmp_path, engine={"num_cpus": 0.5}, trainer={"num_cpus": 0.5}, ray={"resident_trainers": 3})
    with pytest.raises(PlacementError) as error:
        plan_placement(config, TWO_CPUS)
    message = str(error.value)
    assert "3 agents need 3 CPUs" in message and "the cluster has 2" in message
    assert "relay: engine 0.5 + trainer 0.5" in message
    with pytest.raises(PlacementError, match="need 1 GPUs"):
        plan_placement(_config(tmp_path, engine={"num_gpus": 1.0 / 3, "num_cpus": 0.1}), [{"CPU": 8.0}])
    # engines alone fill the machine: no number of swapping trainer workers helps, and the message says so
    with pytest.raises(PlacementError, match=r"3 agents need 4.5 CPUs .*Swapping the trainers does not fit either"):
        plan_placement(_config(tmp_path, engine={"num_cpus": 1.0}, trainer={"num_cpus": 0.5}), [{"CPU": 3.0}])
    with pytest.raises(PlacementError, match=r"3 agents with 2 swapping trainer workers need 2.5 CPUs \(sender: "
                                             r"engine 0.5; relay: engine 0.5; receiver: engine 0.5; 2 trainer "
                                             r"workers x 0.5\); the cluster has 2"):
        plan_placement(_config(tmp_path, engine={"num_cpus": 0.5}, trainer={"num_cpus": 0.5},
                               ray={"resident_trainers": 2}), TWO_CPUS)


def test_requests_that_do_not_fit_resident_fit_by_swapping_the_trainers(tmp_path: Path) -> None:
    config = _config(tmp_path, engine={"num_cpus": 0.5}, trainer={"num_cpus": 0.5})
    plan = plan_placement(config, TWO_CPUS)  # 3 x 0.5 engines + 1 x 0.5 trainer worker = 2 CPUs
    assert plan.trainer_workers == 1 and plan.resident_trainers == []
    assert plan.swapped_trainers == ["sender/trainer", "relay/trainer", "receiver/trainer"]
    assert plan.summary()["trainers"] == ("resident: none; swapped: sender/trainer, relay/trainer, receiver/trainer "
                                          "on 1 trainer workers (trainer-worker-0: sender, relay, receiver), state "
                                          "in the Ray object store between calls")
    assert plan.summary()["total"].startswith("2 of 2 CPU")
    worker = plan.request("trainer-worker-0")
    assert plan.trainer_request("relay") == worker and worker.cpus == 0.5
    # the most workers that fit: 4 CPUs hold 3 engines and 5 half-CPU workers, more than enough for the 3 trainers
    assert plan_placement(config, [{"CPU": 4.0}]).resident_trainers == ["sender/trainer", "relay/trainer",
                                                                        "receiver/trainer"]
    assert plan_placement(config, [{"CPU": 2.5}]).trainer_workers == 2


def test_a_trainer_budget_swaps_even_where_resident_trainers_fit(tmp_path: Path) -> None:
    config = _config(tmp_path, ray={"resident_trainers": 2})
    plan = plan_placement(config, [{"CPU": 8.0}])
    assert [a.name for a in plan.actors][-2:] == ["trainer-worker-0", "trainer-worker-1"]
    assert "trainer-worker-0: sender, receiver; trainer-worker-1: relay" in plan.summary()["trainers"]
    assert plan.trainer_request("relay").name == "trainer-worker-1"
    # a budget at least the number of agents: every trainer resident
    assert plan_placement(_config(tmp_path, ray={"resident_trainers": 5}), [{"CPU": 8.0}]).trainer_workers == 0
    # fitted defaults: the two workers share the machine with the engines
    small = plan_placement(config, TWO_CPUS)
    assert sum(a.cpus for a in small.actors) <= 2.0 and all(a.fitted for a in small.actors)


def test_a_trainer_on_several_workers_reserves_each_and_is_never_swapped(tmp_path: Path) -> None:
    sharded = {"relay": {"trainer": {"workers": 4, "num_cpus": 1.0, "num_gpus": 1.0}}}
    config = _config(tmp_path, sharded, engine={"num_cpus": 0.5, "num_gpus": 0.5}, trainer={"num_cpus": 0.5})
    plan = plan_placement(config, [{"CPU": 8.0, "GPU": 4.0}, {"CPU": 8.0, "GPU": 2.0}])  # GPUs as Ray declares them
    relay = [a for a in plan.actors if a.name.startswith("relay/trainer")]
    assert [a.name for a in relay] == ["relay/trainer", "relay/trainer.1", "relay/trainer.2", "relay/trainer.3"]
    assert all((a.cpus, a.gpus) == (1.0, 1.0) for a in relay) and plan.resident_trainers == [
        "sender/trainer", "relay/trainer", "receiver/trainer"]
    assert plan.summary()["total"] == "6.5 of 16 CPU, 5.5 of 6 GPU"
    # 4 worker GPUs and 3 engine halves are more than 5 GPUs: the arithmetic names the workers
    with pytest.raises(PlacementError, match=r"need 5.5 GPUs \(sender: engine 0.5 \+ trainer 0; relay: engine 0.5 "
                                             r"\+ trainer 4 workers x 1; .*the cluster has 5"):
        plan_placement(config, [{"CPU": 8.0, "GPU": 5.0}])
    # swapping cannot move a sharded trainer: a budget that asks for it is refused, and so is falling back on it
    with pytest.raises(PlacementError, match=r"agents \['relay'\] train on several workers .* swapping cannot move"):
        plan_placement(_config(tmp_path, sharded, ray={"resident_trainers": 2}), [{"CPU": 8.0, "GPU": 4.0}])
    cpus = {"relay": {"trainer": {"workers": 2, "num_cpus": 1.0}}}
    with pytest.raises(PlacementError, match=r"Swapping the trainers cannot help: agents \['relay'\]"):
        plan_placement(_config(tmp_path, cpus, engine={"num_cpus": 0.5}, trainer={"num_cpus": 0.5}), TWO_CPUS)


def test_trainer_workers_config_is_checked(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="LoRA agent's adapters are small enough for one worker"):
        _config(tmp_path, {"relay": {"trainer": {"workers": 2}, "lora": {"rank": 4}}})
    with pytest.raises(ValueError, match="placement group bundle, which cannot be empty"):
        _config(tmp_path, {"relay": {"trainer": {"workers": 2, "num_cpus": 0}}})


def test_defaults_are_fitted_to_the_machine(tmp_path: Path) -> None:
    plan = plan_placement(_config(tmp_path), TWO_CPUS)
    assert all(actor.fitted and actor.cpus == pytest.approx(1 / 3, abs=1e-4) for actor in plan.actors)
    assert sum(actor.cpus for actor in plan.actors) <= 2.0
    assert plan.summary()["total"].startswith("1.9998 of 2 CPU")
    # where the defaults fit, they are kept as they are
    roomy = plan_placement(_config(tmp_path), [{"CPU": 8.0}])
    assert all(not actor.fitted and actor.cpus == 0.5 for actor in roomy.actors)


def test_explicit_requests_are_kept_and_the_defaults_share_what_is_left(tmp_path: Path) -> None:
    config = _config(tmp_path, {"sender": {"engine": {"num_cpus": 1.0}}})
    plan = plan_placement(config, TWO_CPUS)
    assert plan.request("sender/engine").cpus == 1.0 and not plan.request("sender/engine").fitted
    assert all(actor.cpus == pytest.approx(0.2, abs=1e-4) for actor in plan.actors if actor.fitted)


def test_every_actor_must_fit_on_one_node(tmp_path: Path) -> None:
    config = _config(tmp_path, trainer={"num_cpus": 1.5}, engine={"num_cpus": 0.1})
    plan_placement(config, [{"CPU": 6.0}])  # fits the one big node
    with pytest.raises(PlacementError, match=r"needs 1.5 CPU and 0 GPU on one node"):
        plan_placement(config, [{"CPU": 1.0}] * 6)  # 6 CPUs in all, but no node can hold a trainer


PINNED = {"engine_resources": {"engines": 1}, "trainer_resources": {"trainers": 1}}
ENGINE_NODE, TRAINER_NODE = {"CPU": 2.0, "engines": 4.0}, {"CPU": 2.0, "trainers": 4.0}


def test_custom_resources_pin_engines_and_trainers_to_their_nodes(tmp_path: Path) -> None:
    plan = plan_placement(_config(tmp_path, ray=PINNED), [ENGINE_NODE, TRAINER_NODE])
    assert plan.request("relay/engine").resources == {"engines": 1}
    assert plan.request("relay/trainer").resources == {"trainers": 1}
    assert plan.summary()["relay/engine"].endswith(", 1 engines")
    # 3 engines of 0.6 CPU fit the engine node's 2 CPUs; of 0.7 they do not, though the cluster has 4 CPUs
    plan_placement(_config(tmp_path, ray=PINNED, engine={"num_cpus": 0.6}), [ENGINE_NODE, TRAINER_NODE])
    with pytest.raises(PlacementError, match=r"receiver/engine needs 0.7 CPU .* among the 1 nodes with \['engines'\]"):
        plan_placement(_config(tmp_path, ray=PINNED, engine={"num_cpus": 0.7}, trainer={"num_cpus": 0.1}),
                       [ENGINE_NODE, TRAINER_NODE])


def test_a_custom_resource_no_node_offers_is_named(tmp_path: Path) -> None:
    with pytest.raises(PlacementError) as error:
        plan_placement(_config(tmp_path, ray=PINNED), [ENGINE_NODE, {"CPU": 2.0, "gpu_box": 1.0}])
    message = str(error.value)
    assert "ray.trainer_resources asks for custom resource 'trainers'" in message
    assert "offering engines, gpu_box" in message and "ray start --resources" in message
    with pytest.raises(PlacementError, match=r"ask for 3 'engines' in all; the cluster's nodes offer 2"):
        plan_placement(_config(tmp_path, ray=PINNED), [{**ENGINE_NODE, "engines": 2.0}, TRAINER_NODE])


def test_ray_resources_reject_ray_own_and_empty_amounts(tmp_path: Path) -> None:
    from marl_pipeline.config import ConfigError

    with pytest.raises(ConfigError, match="'CPU' is Ray's own resource"):
        _config(tmp_path, ray={"engine_resources": {"CPU": 1}})
    with pytest.raises(ConfigError, match="resource 'trainers': amount 0 must be > 0"):
        _config(tmp_path, ray={"trainer_resources": {"trainers": 0}})


@pytest.mark.launch
def test_a_run_that_cannot_be_placed_fails_before_touching_the_store(local_ray, tmp_path: Path) -> None:
    from marl_pipeline.run.recipe import train

    config = _config(tmp_path, engine={"num_cpus": 0.5}, trainer={"num_cpus": 0.5}, ray={"resident_trainers": 3})
    started = time.monotonic()
    with pytest.raises(PlacementError, match="3 agents need 3 CPUs"):
        next(train(config))
    assert time.monotonic() - started < 60  # no warm-up, no actor started: it did not wait for anything
    assert not (tmp_path / "store").exists()


@pytest.mark.launch
def test_three_agents_train_on_two_cpus_with_the_defaults(local_ray, tmp_path: Path) -> None:
    from marl_pipeline.run.events import RunFinished
    from marl_pipeline.run.recipe import train

    events = list(train(_config(tmp_path)))
    assert isinstance(events[-1], RunFinished)
    assert all(actor.fitted for actor in events[-1].placement.actors)


@pytest.mark.launch
def test_three_agents_with_explicit_half_cpus_train_by_swapping(local_ray, tmp_path: Path) -> None:
    """3 x (engine 0.5 + trainer 0.5 CPU) on 2 CPUs, as written: the plan swaps the trainers through one worker."""
    from marl_pipeline.run.events import RunFinished
    from marl_pipeline.run.recipe import train
    from marl_pipeline.store import ExperienceStore

    config = _config(tmp_path, engine={"num_cpus": 0.5}, trainer={"num_cpus": 0.5})
    events = list(train(config))
    assert isinstance(events[-1], RunFinished)
    assert events[-1].placement.trainer_workers == 1
    assert "trainer-worker-0: sender, relay, receiver" in events[-1].placement.summary()["trainers"]
    store = ExperienceStore(config.store)
    assert all(store.policy_versions("trio", agent) == [0, 1] for agent in RelayOfThree.turn_order)
