"""Swapped trainers: an agent's state moved out of its worker between calls and back trains exactly as a resident
trainer does (parameters, AdamW moments and step counts, bit for bit)."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import ray
import torch

from marl_pipeline.training.batches import TrainBatch
from marl_pipeline.training.swap import AgentSpec, SwappedTrainer, TrainerWorker, actor_handles
from marl_pipeline.training.trainer import PolicyTrainer

pytestmark = pytest.mark.launch

OPTIONS = {  # agents that differ, so a state landing in the wrong shell would show
    "a": dict(lr=1e-2, seed=0),
    "b": dict(lr=3e-3, seed=1, weight_decay=0.1),
    "c": dict(lr=1e-2, seed=2, kl_coef=0.1, entropy_coef=0.01),  # a frozen reference moves too
}


def _options(agent: str, model_dir: Path) -> dict:
    options = {"weight_decay": 0.0, "max_grad_norm": 1.0, "clip_eps": 0.2, "num_threads": 1, "chunk_tokens": 24,
               **OPTIONS[agent]}
    if options.get("kl_coef"):
        options["reference_dir"] = str(model_dir)
    return options


def _batch(rng: np.random.Generator, rows: int = 6, vocab: int = 200) -> TrainBatch:
    prompts = [rng.integers(1, vocab, size=rng.integers(2, 6)).tolist() for _ in range(rows)]
    responses = [rng.integers(1, vocab, size=rng.integers(1, 8)).tolist() for _ in range(rows)]
    old = [(-rng.random(len(r)) * 3).tolist() for r in responses]
    return TrainBatch(prompts, responses, old, rng.normal(size=rows).tolist())


def _assert_same_state(resident: PolicyTrainer, swapped: PolicyTrainer) -> None:
    for mine, theirs in zip(resident.model.parameters(), swapped.model.parameters(), strict=True):
        assert torch.equal(mine, theirs)
    resident_state, swapped_state = resident.optimizer.state_dict(), swapped.optimizer.state_dict()
    assert resident_state["state"].keys() == swapped_state["state"].keys() and resident_state["state"]
    for index, moments in resident_state["state"].items():
        for name, value in moments.items():
            assert torch.equal(value, swapped_state["state"][index][name]), (index, name)
    assert resident.version == swapped.version


def test_swapped_training_is_bit_identical_to_resident(local_ray, tiny_model_dir: Path) -> None:
    agents = list(OPTIONS)
    resident = {agent: PolicyTrainer(str(tiny_model_dir), 0, **_options(agent, tiny_model_dir)) for agent in agents}
    # One worker serving three agents: every call of another agent swaps, the worst case.
    worker = TrainerWorker({agent: AgentSpec(str(tiny_model_dir), 0, _options(agent, tiny_model_dir))
                            for agent in agents})
    rng = np.random.default_rng(0)
    for _step in range(3):  # three optimizer steps: AdamW's moments and step counts are carried across swaps
        for _micro_batch in range(2):  # gradients are carried across swaps within a step
            for agent in agents:
                batch = _batch(rng)
                mine, theirs = resident[agent].accumulate(batch), worker.call(agent, "accumulate", batch)
                assert mine.pop("compute_seconds") > 0 and theirs.pop("compute_seconds") > 0  # timed, not compared
                assert mine == theirs
        for agent in agents:
            alone, served = resident[agent].apply_step(), worker.call(agent, "apply_step")
            assert alone == served and alone.swaps == 0
            # the worker's swapping so far, which the version's timing.json records
            stats = worker.swap_stats()
            assert served.swaps == stats.swaps_in + stats.swaps_out > 0
            assert served.swap_seconds == stats.seconds_in + stats.seconds_out > 0
            for (name, mine), (other, theirs) in zip(resident[agent].named_weights(),
                                                     worker.call(agent, "named_weights"), strict=True):
                assert name == other and torch.equal(mine, theirs)
    last = worker.loaded
    for agent in agents:
        if agent != last:  # swapped out: no parameter storage left in the worker, the state is in the object store
            assert all(p.numel() == 0 for p in worker.trainers[agent].model.parameters())
            assert not worker.trainers[agent].optimizer.state and agent in worker.swapped
        worker.call(agent, "policy_version")  # a readiness check swaps nothing
        assert worker.loaded == last
    for agent in agents:
        _assert_same_state(resident[agent], worker._load(agent))
    moved = max((a - b).abs().max().item() for a, b in zip(
        resident["a"].model.parameters(), PolicyTrainer(str(tiny_model_dir), 0, **_options("a", tiny_model_dir))
        .model.parameters()))
    assert moved > 1e-3  # the steps did change the parameters
    stats = worker.swap_stats()
    params = sum(p.numel() * 4 for p in resident["a"].model.parameters())
    # between the micro-batches of a step the gradients travel too; after a step, AdamW's two moments
    assert stats.swaps_out >= 3 * 3 * 2 and stats.bytes_out >= stats.swaps_out * params
    assert stats.bytes_in == stats.bytes_out - _loaded_bytes(worker)


def _loaded_bytes(worker: TrainerWorker) -> int:
    """What the worker's last swap-out put and nothing has swapped in since (none: every swap out was swapped in,
    except the states still in the store)."""
    from marl_pipeline.training.swap import state_bytes

    return sum(state_bytes(ray.get(ref)) for ref in worker.swapped.values())


def test_an_agent_the_worker_does_not_serve_is_named(local_ray, tiny_model_dir: Path) -> None:
    worker = TrainerWorker({"a": AgentSpec(str(tiny_model_dir), 0, _options("a", tiny_model_dir))})
    with pytest.raises(KeyError, match=r"agent 'b' is not served by this trainer worker \(it serves \['a'\]\)"):
        worker.call("b", "apply_step")


def test_swapped_trainer_actors_match_resident_ones(local_ray, tmp_path: Path, tiny_model_dir: Path) -> None:
    """Through Ray as a run spawns them (``start_trainers``, budget 1 for 3 agents) against resident actors."""
    from marl_pipeline.cluster.spawn import Workers, plan_on_ray, start_trainers
    from marl_pipeline.config import parse_config
    from marl_pipeline.store import ExperienceStore
    from tests.test_placement import RelayOfThree  # noqa: F401  (registers relay_of_three)

    agents = {role: {"trainer": {"num_cpus": 0.25, "threads": 1, "lr": 1e-2}} for role in ("sender", "relay",
                                                                                            "receiver")}
    data = {"run": "swap", "store": str(tmp_path / "store"), "environment": {"name": "relay_of_three"},
            "agents": agents}
    resident_config = parse_config(data)
    swapped_config = parse_config({**data, "ray": {"resident_trainers": 1}})
    store = ExperienceStore(resident_config.store)
    for agent in agents:
        shutil.copytree(tiny_model_dir, store.policy_dir("swap", agent, 0))
    versions = dict.fromkeys(agents, 0)
    resident = start_trainers(plan_on_ray(resident_config), store, versions)
    swapped = start_trainers(plan_on_ray(swapped_config), store, versions)
    assert all(isinstance(handle, SwappedTrainer) for handle in swapped.values())
    assert len({handle.worker._actor_id for handle in swapped.values()}) == 1
    rng = np.random.default_rng(1)
    try:
        for _step in range(2):
            for _micro_batch in range(2):
                batches = {agent: _batch(rng) for agent in agents}
                for trainers in (resident, swapped):  # issued without waiting, as the train stage does
                    refs = [trainers[agent].accumulate.remote(batches[agent]) for agent in agents]
                    ray.get(refs)
            steps = {name: [trainers[agent].apply_step.remote() for agent in agents]
                     for name, trainers in (("resident", resident), ("swapped", swapped))}
            assert ray.get(steps["resident"]) == ray.get(steps["swapped"])
        for agent in agents:
            mine, theirs = ray.get([resident[agent].named_weights.remote(), swapped[agent].named_weights.remote()])
            assert all(torch.equal(a, b) for (_, a), (_, b) in zip(mine, theirs, strict=True))
            assert ray.get(swapped[agent].policy_version.remote()) == 2
        stats = ray.get(swapped["sender"].worker.swap_stats.remote())
        assert stats.swaps_out >= 2 * 2 * 3
        # a checkpoint from a swapped trainer is the resident one's: a resumed launch continues from either
        ray.get([resident["relay"].save.remote(str(tmp_path / "resident")),
                 swapped["relay"].save.remote(str(tmp_path / "swapped"))])
        reloaded = {name: PolicyTrainer(str(tmp_path / name), 2, **_options("a", tiny_model_dir))
                    for name in ("resident", "swapped")}
        _assert_same_state(reloaded["resident"], reloaded["swapped"])
    finally:
        for handle in resident.values():
            ray.kill(handle)
        Workers(engines={}, trainers=swapped).shutdown()  # the one worker behind the three handles
    assert len(actor_handles(swapped)) == 1
    deadline = time.monotonic() + 30  # ray.kill takes effect asynchronously
    with pytest.raises(ray.exceptions.RayActorError):
        while time.monotonic() < deadline:
            ray.get(swapped["sender"].policy_version.remote())
            time.sleep(0.5)


def test_the_train_stage_alternates_its_order_so_a_worker_swaps_half_as_often(local_ray, tiny_model_dir: Path) -> None:
    from marl_pipeline.stages.training import issue_order

    rng = np.random.default_rng(2)
    batches = [{agent: _batch(rng) for agent in ("a", "b")} for _ in range(4)]
    swaps = {}
    for alternate in (False, True):
        worker = TrainerWorker({agent: AgentSpec(str(tiny_model_dir), 0, _options(agent, tiny_model_dir))
                                for agent in ("a", "b")})
        for index, batch in enumerate(batches):
            for agent in issue_order(["a", "b"], index) if alternate else ["a", "b"]:
                worker.call(agent, "accumulate", batch[agent])
        swaps[alternate] = worker.swap_stats().swaps_out
    # one order: a b | a b | a b | a b swaps at every change but the first; alternating: a b | b a | a b | b a
    assert swaps == {False: 7, True: 4}
    assert issue_order(["a", "b", "c"], 0) == ["a", "b", "c"] and issue_order(["a", "b", "c"], 3) == ["c", "b", "a"]
