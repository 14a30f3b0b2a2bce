"""GPU placement without a GPU: the 8-GPU example plans, split engines and sharded trainers get whole GPUs of their
placement groups, checked on Ray's logical GPUs (``num_gpus`` declared on this CPU node)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from marl_pipeline.cluster.options import actor_options
from marl_pipeline.cluster.placement import PlacementError, plan_placement
from marl_pipeline.config import ConfigError, EngineConfig, parse_config
from marl_pipeline.environment import build_environment

ROOT = Path(__file__).resolve().parents[1]


def test_the_8_gpu_example_parses_and_plans_on_one_node() -> None:
    config = parse_config(yaml.safe_load((ROOT / "configs" / "gpu_8x_llama1b.yaml").read_text()))
    build_environment(config.environment.name, config.environment.options)
    plan = plan_placement(config, [{"CPU": 96.0, "GPU": 8.0}])
    assert plan.summary()["total"] == "24 of 96 CPU, 8 of 8 GPU"
    assert {actor.name: actor.gpus for actor in plan.actors} == {
        "solver/engine": 2.0, "solver/trainer": 1.0, "solver/trainer.1": 1.0,
        "verifier/engine": 2.0, "verifier/trainer": 1.0, "verifier/trainer.1": 1.0}
    with pytest.raises(PlacementError, match=r"need 8 GPUs \(solver: engine 2 \+ trainer 2 workers x 1; .*has 7"):
        plan_placement(config, [{"CPU": 96.0, "GPU": 7.0}])
    # a split engine's GPUs are on one node: two nodes of 1 GPU each hold no 2-GPU engine
    with pytest.raises(PlacementError, match="solver/engine needs 4 CPU and 2 GPU on one node"):
        plan_placement(config, [{"CPU": 48.0, "GPU": 1.0}] * 8)


def test_the_colocated_8_gpu_example_shares_each_gpu_between_an_engine_rank_and_a_trainer_rank() -> None:
    config = parse_config(yaml.safe_load((ROOT / "configs" / "gpu_8x_llama1b_colocated.yaml").read_text()))
    plan = plan_placement(config, [{"CPU": 96.0, "GPU": 8.0}])
    assert plan.summary()["total"] == "40 of 96 CPU, 8 of 8 GPU"
    assert {actor.name: actor.gpus for actor in plan.actors if actor.name.startswith("solver")} == {
        "solver/engine": 2.0, **{f"solver/trainer{f'.{k}' if k else ''}": 0.5 for k in range(4)}}
    # each agent's 4 shared GPUs on one node: two 4-GPU nodes hold the pairs, four 2-GPU nodes do not
    plan_placement(config, [{"CPU": 48.0, "GPU": 4.0}] * 2)
    with pytest.raises(PlacementError, match=r"solver/engine\+trainer needs 20 CPU and 4 GPU on one node"):
        plan_placement(config, [{"CPU": 48.0, "GPU": 2.0}] * 4)


def test_a_split_engine_reserves_whole_gpus_in_its_placement_group() -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size 2 splits a replica over that many whole GPUs: set "
                                         "num_gpus to 2"):
        EngineConfig(tensor_parallel_size=2, num_gpus=1)
    data = yaml.safe_load((ROOT / "configs" / "demo_solver_alone.yaml").read_text())
    data["agents"]["solver"]["engine"] = {"tensor_parallel_size": 4, "num_gpus": 4, "num_cpus": 2}
    data["ray"] = {"engine_resources": {"big_node": 1.0}}
    plan = plan_placement(parse_config(data), [{"CPU": 8.0, "GPU": 8.0, "big_node": 1.0}])
    spec = plan.agent_specs("solver", "engine")[0]
    assert (spec.group.kind, spec.group.strategy, spec.bundle) == ("engine", "STRICT_PACK", 0)
    assert spec.group.bundles == ({"GPU": 1.0, "CPU": 2.0, "big_node": 1.0}, {"GPU": 1.0}, {"GPU": 1.0}, {"GPU": 1.0})
    assert actor_options(spec)["num_gpus"] == 0 and spec.capture_children  # vLLM's workers take the group's GPUs


PROBE = textwrap.dedent("""
    import json, os, sys
    import ray, yaml
    from marl_pipeline.cluster import warm_actors
    from marl_pipeline.cluster.options import actor_options, placement_group
    from marl_pipeline.cluster.placement import plan_placement
    from marl_pipeline.cluster.spawn import start_trainers
    from marl_pipeline.config import parse_config
    from tests import logical_gpus

    store = logical_gpus.start(sys.argv[1], sys.argv[2])
    # The solver alone, planned on this node as a run plans it, in the layout its parallelism_by_length gives
    # turns of 100 tokens or more (as a run lays an agent out between steps, run/layouts.py): a trainer on 2 workers
    # of 1 GPU each, every rank seeing its own GPU (and training on the CPU: none is real), and an engine replica
    # split over 2 GPUs
    data = yaml.safe_load(open("configs/demo_solver_alone.yaml"))
    data |= {"run": "r", "store": sys.argv[2]}
    data["agents"]["solver"] |= {"engine": {"num_gpus": 1, "num_cpus": 0.5},
                                 "trainer": {"num_gpus": 1, "num_cpus": 0.5, "threads": 1},
                                 "parallelism_by_length": [{"from_tokens": 100, "tensor_parallel_size": 2,
                                                            "trainer_workers": 2}]}
    config = parse_config(data)
    plan = plan_placement(config.laid_out({"solver": config.agents["solver"].layout_at(100)}),
                          [{"CPU": 2.0, "GPU": 4.0}])
    leader = start_trainers(plan, store, {"solver": 0})["solver"]
    devices = lambda actor: ray.get(actor.__ray_call__.remote(
        lambda self: (os.environ["CUDA_VISIBLE_DEVICES"], str(self.device), ray.get_runtime_context().get_node_id())))
    followers = ray.get(leader.__ray_call__.remote(lambda self: self.followers))
    ranks = [devices(leader)] + [devices(f) for f in followers]
    warm_actors.release(leader, keep=False)  # its ranks stop, its placement group goes with them
    # The split replica: the engine actor is assigned no GPU, its children (vLLM's workers) one each
    spec = plan.agent_specs("solver", "engine")[0]
    split = placement_group(spec.group)

    @ray.remote
    class Engine:
        def devices(self):
            # as vLLM's Ray executor starts its workers: num_cpus=0, num_gpus=1, in the current placement group
            worker = ray.remote(num_gpus=1, num_cpus=0)(lambda: os.environ["CUDA_VISIBLE_DEVICES"])
            return ray.get_gpu_ids(), sorted(ray.get([worker.remote() for _ in range(2)]))

    own, workers = ray.get(Engine.options(**actor_options(spec, split)).remote().devices.remote())
    table = ray.util.placement_group_table(split)
    print(json.dumps({"ranks": ranks, "engine": own, "workers": workers, "strategy": table["strategy"],
                      "bundles": list(table["bundles"].values())}))
""")


@pytest.mark.launch
def test_ranks_and_split_engine_workers_each_get_their_own_logical_gpu(tiny_model_dir: Path, tmp_path: Path) -> None:
    # Its own Ray instance (4 logical GPUs), in a child process: the suite's shared instance declares none.
    result = subprocess.run([sys.executable, "-c", PROBE, str(tiny_model_dir), str(tmp_path / "store")], cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    probe = json.loads(result.stdout.strip().splitlines()[-1])
    visible = [rank[0] for rank in probe["ranks"]]
    assert len(set(visible)) == 2 and all(v in {"0", "1", "2", "3"} for v in visible)
    assert all(rank[1] == "cpu" for rank in probe["ranks"])  # logical GPUs: torch sees no CUDA, trains on the CPU
    assert probe["engine"] == [] and len(set(probe["workers"])) == 2 and set(probe["workers"]) <= {"0", "1", "2", "3"}
    assert probe["strategy"] == "STRICT_PACK" and probe["bundles"] == [{"GPU": 1.0, "CPU": 0.5}, {"GPU": 1.0}]


def test_each_layout_by_length_is_checked_as_an_experiment_and_planned_in_its_own_gpus() -> None:
    """``parallelism_by_length``: entries whose lengths do not increase, a split engine without GPUs, an entry the
    agent's other settings refuse (LoRA on 2 workers) or the experiment's (replicas moved between agents that ask for
    different GPUs) fail at parse time naming the entry; each entry lays the agent out in its own GPUs."""
    data = yaml.safe_load((ROOT / "configs" / "demo_solver_alone.yaml").read_text())
    solver = data["agents"]["solver"]
    solver |= {"engine": {"num_gpus": 1}, "trainer": {"num_gpus": 1},
               "parallelism_by_length": [{"from_tokens": 512, "trainer_workers": 2},
                                         {"from_tokens": 4096, "tensor_parallel_size": 2, "trainer_workers": 4}]}
    config = parse_config(data)
    agent = config.agents["solver"]
    assert [agent.layout_at(n) for n in (0, 511, 512, 4095, 4096, 10**6)] == [None, None, 0, 0, 1, 1]
    widest = config.laid_out({"solver": 1}).agents["solver"]
    assert (widest.engine.tensor_parallel_size, widest.engine.num_gpus, widest.trainer.workers) == (2, 2.0, 4)
    assert config.laid_out({"solver": None}) is config
    plan_placement(config.laid_out({"solver": 0}), [{"CPU": 4.0, "GPU": 3.0}])
    with pytest.raises(PlacementError, match=r"need 6 GPUs"):
        plan_placement(config.laid_out({"solver": 1}), [{"CPU": 4.0, "GPU": 5.0}])

    def refused(entries: list[dict], match: str, **agent) -> None:
        changed = {**data, "agents": {"solver": {**solver, **agent, "parallelism_by_length": entries}}}
        with pytest.raises(ConfigError, match=match):
            parse_config(changed)

    refused([{"from_tokens": 512}, {"from_tokens": 512}], r"from_tokens must increase .*\[512, 512\]")
    refused([{"from_tokens": 9, "tensor_parallel_size": 2}], r"parallelism_by_length\[0\] \(from 9 tokens\): "
            r"tensor_parallel_size 2 splits a replica over GPUs, and engine.num_gpus is 0", engine={"num_gpus": 0})
    refused([{"from_tokens": 9, "trainer_workers": 2}], r"parallelism_by_length\[0\] \(from 9 tokens\): "
            r"trainer.workers 2 shards full fine-tuning", lora={"rank": 4})
    solo = yaml.safe_load((ROOT / "configs" / "demo.yaml").read_text())  # two agents, replicas moved between them
    solo["pipeline"]["rollout"] = {"rebalance_replicas": True}
    solo["agents"] = {name: {**agent, "hybrid": False, "engine": {"num_gpus": 1}, "trainer": {"num_gpus": 1}}
                      for name, agent in solo["agents"].items()}
    solo["agents"]["solver"]["parallelism_by_length"] = [{"from_tokens": 9, "tensor_parallel_size": 2}]
    with pytest.raises(ConfigError, match=r"with agents.solver.parallelism_by_length\[0\]:\n  pipeline.rollout."
                                          r"rebalance_replicas: .*they ask for \{'solver': \(0.5, 2.0\)"):
        parse_config(solo)
