"""An agent's engine and trainer sharing its GPUs and taking turns (``agents.<a>.colocated``, cluster/colocation.py):
what the config refuses, the placement plan's arithmetic, the shared GPUs on Ray's logical GPUs (declared on this CPU
node), and a real launch on the CPU where the engines sleep while their trainers train and the result is the
disaggregated run's."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from safetensors.torch import load_file

from marl_pipeline.cluster.placement import PlacementError, plan_placement
from marl_pipeline.config import ConfigError, parse_config
from marl_pipeline.run.events import PolicyCommitted, RunFinished
from marl_pipeline.run.recipe import train
from marl_pipeline.store import ExperienceStore
from tests.conftest import small_config_data

ROOT = Path(__file__).resolve().parents[1]


def _colocated(data: dict, agents=("solver", "verifier"), gpus: int = 0, **pipeline) -> dict:
    data = {**data, "pipeline": {**data["pipeline"], "mode": "synchronous", **pipeline}}
    data["agents"] = {name: dict(agent) for name, agent in data["agents"].items()}
    for name in agents:
        agent = data["agents"][name]
        agent["colocated"] = True
        if gpus:
            agent["engine"] = {**agent.get("engine", {}), "num_gpus": gpus, "tensor_parallel_size": gpus}
            agent["trainer"] = {**agent.get("trainer", {}), "num_gpus": 1, "workers": gpus}
    return data


def test_the_config_refuses_what_colocation_cannot_do(demo_config_data: dict) -> None:
    parse_config(_colocated(demo_config_data))
    with pytest.raises(ConfigError, match=r"agents \['solver', 'verifier'\] are colocated: pipeline.mode must be "
                                          r"synchronous: .*streaming overlaps them"):
        parse_config(_colocated(demo_config_data, mode="streaming"))
    with pytest.raises(ConfigError, match=r"ray.weight_sync must be object_store: NCCL refuses two ranks"):
        parse_config({**_colocated(demo_config_data), "ray": {"weight_sync": "broadcast"}})
    with pytest.raises(ConfigError, match=r"ray.resident_trainers: 1 would swap their trainers out"):
        parse_config({**_colocated(demo_config_data), "ray": {"resident_trainers": 1}})
    data = _colocated(demo_config_data, agents=("solver",))
    data["agents"]["solver"]["engine"] = {"replicas": 2}
    with pytest.raises(ConfigError, match=r"agents.solver: .*colocated: .*engine.replicas is 2"):
        parse_config(data)
    data["agents"]["solver"]["engine"] = {"num_gpus": 2, "tensor_parallel_size": 2}
    with pytest.raises(ConfigError, match=r"trainer.workers \(1\) must equal engine.tensor_parallel_size \(2\)"):
        parse_config(data)
    data["agents"]["solver"]["engine"] = {"num_gpus": 1}
    data["agents"]["solver"]["trainer"] = {"num_gpus": 0.5}
    with pytest.raises(ConfigError, match=r"set trainer.num_gpus to 1 \(it is 0.5\) and engine.num_gpus to 1"):
        parse_config(data)


def test_the_plan_gives_each_shared_gpu_half_to_the_engine_and_half_to_the_trainer(demo_config_data: dict) -> None:
    one = parse_config(_colocated(demo_config_data, gpus=1))
    plan = plan_placement(one, [{"CPU": 8.0, "GPU": 2.0}])
    assert {actor.name: actor.gpus for actor in plan.actors} == {
        "solver/engine": 0.5, "solver/trainer": 0.5, "verifier/engine": 0.5, "verifier/trainer": 0.5}
    assert plan.summary()["total"] == "2 of 8 CPU, 2 of 2 GPU"
    assert plan.summary()["solver/engine"].endswith("GPUs shared by solver's engine and trainer")
    plan_placement(one, [{"CPU": 4.0, "GPU": 1.0}] * 2)  # one agent's pair on each node
    with pytest.raises(PlacementError, match=r"2 agents need 3 GPUs \(solver: engine 0.5 \+ trainer 0.5; verifier: "
                                             r"engine 1 \+ trainer 1\); the cluster has 2"):
        data = _colocated(demo_config_data, agents=("solver",), gpus=1)
        data["agents"]["verifier"] = {**data["agents"]["verifier"], "engine": {"num_gpus": 1},
                                      "trainer": {"num_gpus": 1}}
        plan_placement(parse_config(data), [{"CPU": 8.0, "GPU": 2.0}])
    two = parse_config(_colocated(demo_config_data, agents=("solver",), gpus=2))
    assert {a.name: a.gpus for a in plan_placement(two, [{"CPU": 8.0, "GPU": 2.0}]).actors if "solver" in a.name} == {
        "solver/engine": 1.0, "solver/trainer": 0.5, "solver/trainer.1": 0.5}
    # The engine's two ranks and the trainer's two share two GPUs of one node: two 1-GPU nodes cannot hold them.
    with pytest.raises(PlacementError, match=r"solver/engine\+trainer needs 1.5 CPU and 2 GPU on one node"):
        plan_placement(two, [{"CPU": 8.0, "GPU": 1.0}] * 2)


PROBE = textwrap.dedent("""
    import json, os, sys
    import ray, yaml
    from marl_pipeline.cluster.options import actor_options, placement_group
    from marl_pipeline.cluster.placement import plan_placement
    from marl_pipeline.cluster.spawn import start_trainers
    from marl_pipeline.config import parse_config
    from tests import logical_gpus

    store = logical_gpus.start(sys.argv[1], sys.argv[2])
    seen = lambda actor: ray.get(actor.__ray_call__.remote(lambda self: os.environ.get("CUDA_VISIBLE_DEVICES")))

    def plan(engine, trainer):
        # the colocated solver alone, planned on this node, as a run plans it
        data = yaml.safe_load(open("configs/demo_solver_alone.yaml"))
        data |= {"run": "r", "store": sys.argv[2], "pipeline": {**data["pipeline"], "mode": "synchronous"}}
        data["agents"]["solver"] |= {"colocated": True, "engine": engine, "trainer": {**trainer, "threads": 1}}
        return plan_placement(parse_config(data), [{"CPU": 2.0, "GPU": 4.0}])

    @ray.remote
    class Probe:
        def devices(self):
            # as vLLM's Ray executor starts a split engine's workers: VLLM_RAY_PER_WORKER_GPUS of a GPU each, in the
            # bundles VLLM_RAY_BUNDLE_INDICES names, of the placement group its engine actor runs in
            per_worker = float(os.environ.get("VLLM_RAY_PER_WORKER_GPUS", "1"))
            bundles = [int(k) for k in os.environ.get("VLLM_RAY_BUNDLE_INDICES", "").split(",") if k]
            group = ray.util.get_current_placement_group()
            workers = [ray.remote(num_gpus=per_worker, num_cpus=0)(lambda: os.environ["CUDA_VISIBLE_DEVICES"]).options(
                scheduling_strategy=ray.util.scheduling_strategies.PlacementGroupSchedulingStrategy(
                    group, placement_group_bundle_index=k)).remote() for k in bundles]
            return os.environ.get("CUDA_VISIBLE_DEVICES"), ray.get(workers)

    # One GPU: the engine and the trainer in bundle 0, each with half of it
    one = plan({"num_gpus": 1, "num_cpus": 0.25}, {"num_gpus": 1, "num_cpus": 0.25})
    spec = one.agent_specs("solver", "engine")[0]
    group = placement_group(spec.group)
    engine = Probe.options(**actor_options(spec, group)).remote()
    trainer = start_trainers(one, store, {"solver": 0}, groups={"solver": group})["solver"]
    result = {"one": {"engine": ray.get(engine.devices.remote()), "trainer": seen(trainer),
                      "bundles": list(ray.util.placement_group_table(group)["bundles"].values())}}
    ray.kill(engine), ray.kill(trainer), ray.util.remove_placement_group(group)

    # Two GPUs: the engine split over both (its workers half of each), the trainer on 2 ranks, rank k on GPU k
    two = plan({"num_gpus": 2, "tensor_parallel_size": 2, "num_cpus": 0.25},
               {"num_gpus": 1, "workers": 2, "num_cpus": 0.25})
    spec = two.agent_specs("solver", "engine")[0]
    group = placement_group(spec.group)
    engine = Probe.options(**actor_options(spec, group)).remote()
    leader = start_trainers(two, store, {"solver": 0}, groups={"solver": group})["solver"]
    followers = ray.get(leader.__ray_call__.remote(lambda self: self.followers))
    table = ray.util.placement_group_table(group)
    result["two"] = {"engine": ray.get(engine.devices.remote()), "ranks": [seen(leader)] + [seen(f) for f in followers],
                     "bundles": list(table["bundles"].values()), "strategy": table["strategy"]}
    print(json.dumps(result))
""")


@pytest.mark.launch
def test_engine_and_trainer_ranks_see_the_same_logical_gpus(tiny_model_dir: Path, tmp_path: Path) -> None:
    # Its own Ray instance (4 logical GPUs), in a child process: the suite's shared instance declares none.
    result = subprocess.run([sys.executable, "-c", PROBE, str(tiny_model_dir), str(tmp_path / "store")], cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    probe = json.loads(result.stdout.strip().splitlines()[-1])
    one, two = probe["one"], probe["two"]
    assert one["bundles"] == [{"GPU": 1.0, "CPU": 0.5}]
    assert one["engine"][0] == one["trainer"] and one["trainer"] in {"0", "1", "2", "3"}  # one GPU, seen by both
    assert two["strategy"] == "STRICT_PACK" and two["bundles"] == [{"GPU": 1.0, "CPU": 0.5}, {"GPU": 1.0, "CPU": 0.25}]
    own, workers = two["engine"]
    assert not own and len(set(workers)) == 2  # the engine actor holds none; its workers one GPU each ...
    assert two["ranks"] == workers  # ... the GPU that trainer rank k has too


@pytest.mark.launch
def test_colocated_engines_sleep_while_their_trainers_train_and_the_run_is_the_disaggregated_one(
        local_ray, demo_config_data, tmp_path: Path) -> None:
    stores = {}
    for name, data in (("apart", demo_config_data), ("colocated", _colocated(demo_config_data))):
        data = small_config_data(data, tmp_path / name, steps=3, mode="synchronous")
        data["store"] = {"uri": str(tmp_path / name), "retention": {"keep_all": True}}
        config = parse_config(data)
        events = list(train(config))
        assert isinstance(events[-1], RunFinished)
        stores[name] = store = ExperienceStore(config.store)
        committed = [event for event in events if isinstance(event, PolicyCommitted)]
        assert len(committed) == 6
        updates = store.read_stage("demo", "policy_updates", columns=["step", "stage_started", "stage_ended"])
        for event in committed:
            record = json.loads(store.checkpoints.read_file("demo", event.agent, event.version, "timing.json"))
            if name == "apart":
                assert record["engine_asleep"] is None
                continue
            slept, woke = record["engine_asleep"]
            # The step's training ran while the agent's engine slept, and it woke only to load the version it made.
            trained = [row for row in updates.to_pylist() if row["step"] == event.step]
            assert slept <= min(row["stage_started"].timestamp() for row in trained)
            assert max(row["stage_ended"].timestamp() for row in trained) <= woke
    for agent in ("solver", "verifier"):
        apart, colocated = (load_file(stores[n].policy_dir("demo", agent, 3) / "model.safetensors")
                            for n in ("apart", "colocated"))
        assert max((apart[k] - colocated[k]).abs().max().item() for k in apart) <= 1e-6, agent


def test_the_plan_says_which_agents_hand_over_and_which_trainers_the_core_split_moves(demo_config_data: dict) -> None:
    """The run-time reads these from the plan its actors were started from (issue 71.2): the orchestrator's
    hand-overs (``GpuHandover``) and the core split (``CoreSplit.for_run``), never the config again."""
    nodes = [{"CPU": 2.0}]
    plan = plan_placement(parse_config(_colocated(demo_config_data, agents=("solver",))), nodes)
    assert plan.handovers == ("solver",) and plan.movable_trainers == ()  # synchronous: no trainer moves
    streaming = copy.deepcopy(demo_config_data)
    assert plan_placement(parse_config(streaming), nodes).movable_trainers == ("solver/trainer", "verifier/trainer")
    streaming["agents"]["verifier"]["trainer"] = {"threads": 1}  # its threads set: the split leaves it
    assert plan_placement(parse_config(streaming), nodes).movable_trainers == ("solver/trainer",)
    swapped = parse_config({**streaming, "ray": {"resident_trainers": 1}})  # one worker swaps both: none moves
    assert plan_placement(swapped, nodes).movable_trainers == () and plan_placement(swapped, nodes).handovers == ()
