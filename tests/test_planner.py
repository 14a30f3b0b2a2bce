"""The planner (marl_pipeline/planner/): shared cores, the simulated orchestrator's decisions, ``marl plan``."""

from __future__ import annotations

import copy

import pytest
import simpy

from marl_pipeline.cluster.placement import PlacementError, plan_placement
from marl_pipeline.config import parse_config
from marl_pipeline.planner.costs import Costs, EngineCosts, TrainerCosts, Turn, pooled
from marl_pipeline.planner.plan import parse_cluster, predict
from marl_pipeline.planner.shared_cores import SharedCores
from marl_pipeline.planner.simulate import simulate

ENGINE = EngineCosts(step=0.01, per_sequence=0.0005, per_prompt_token=0.00005)
TRAINER = TrainerCosts(call=0.05, per_token=0.0002, apply=0.1, sync_per_replica=0.05, commit=0.2)


def _costs(episodes: list[list[Turn]] | None = None) -> Costs:
    episodes = episodes or [[Turn("solver", 40, 4), Turn("verifier", 60, 2)]] * 64
    return Costs({"solver": ENGINE, "verifier": ENGINE}, {"solver": TRAINER, "verifier": TRAINER}, environment=0.05,
                 reward=0.05, rollout_overhead=0.1, train_overhead=0.05, episodes=episodes, source="hand-made")


def _config(demo_config_data: dict, replicas: int = 1, **pipeline):
    data = copy.deepcopy(demo_config_data)
    data["pipeline"].update({"steps": 4, **pipeline})
    for agent in data["agents"].values():
        agent["engine"] = {**agent.get("engine", {}), "replicas": replicas}
    return parse_config(data)


def _finish_times(jobs: list[tuple[float, float, int]], cores: float) -> list[float]:
    """When each (start, core-seconds, threads) job ends on ``cores`` shared cores."""
    env = simpy.Environment()
    shared, ends = SharedCores(env, cores), {}

    def job(index: int, start: float, work: float, threads: int):
        yield env.timeout(start)
        yield shared.compute(work, threads)
        ends[index] = env.now

    for index, (start, work, threads) in enumerate(jobs):
        env.process(job(index, start, work, threads))
    env.run()
    return [ends[index] for index in range(len(jobs))]


def test_jobs_beyond_the_cores_share_them() -> None:
    assert _finish_times([(0, 1.0, 1)], cores=1) == [1.0]
    assert _finish_times([(0, 1.0, 1), (0, 1.0, 1)], cores=1) == [2.0, 2.0]  # each at half speed
    assert _finish_times([(0, 2.0, 2)], cores=2) == [1.0]
    assert _finish_times([(0, 1.0, 1), (0, 1.0, 1)], cores=2) == [1.0, 1.0]  # a core each
    # one alone for 0.5 s (0.5 done), then both at half speed: the first's last 0.5 takes 1 s, the second then
    # has 0.5 left alone
    assert _finish_times([(0, 1.0, 1), (0.5, 1.0, 1)], cores=1) == pytest.approx([1.5, 2.0])
    # a 2-thread job and a 1-thread job on 2 cores: 3 threads, each at 2/3 of a core
    assert _finish_times([(0, 2.0, 2), (0, 1.0, 1)], cores=2) == pytest.approx([1.5, 1.5])


def test_turns_use_the_versions_the_staleness_gate_allows(demo_config_data: dict) -> None:
    for staleness in (0, 1):
        config = _config(demo_config_data, staleness=staleness)
        nodes = [{"CPU": 2.0}]
        prediction = simulate(plan_placement(config, nodes), config.pipeline, _costs(), nodes)
        lags = {d.step - d.version for d in prediction.decisions}
        assert lags == ({0} if staleness == 0 else {0, 1})  # staleness 1 lets rollout run a step ahead
        assert len(prediction.step_seconds) == 4 and sum(prediction.staleness.values()) == 4 * 2 * 256 * 2
        # the gate released step i once every agent's engines served version i - staleness, and not later
        for step in range(1 + staleness, 4):
            served = max(prediction.served[agent][step - staleness] for agent in ("solver", "verifier"))
            assert prediction.released[step] == pytest.approx(served)


def test_replicas_share_an_agents_turns_and_an_episode_stays_on_its_replica(demo_config_data: dict) -> None:
    config = _config(demo_config_data, replicas=2)
    nodes = [{"CPU": 2.0}]
    episodes = [[Turn("solver", 40, 4), Turn("verifier", 60, 2), Turn("solver", 80, 4)]] * 64
    prediction = simulate(plan_placement(config, nodes), config.pipeline, _costs(episodes), nodes, steps=2)
    by_replica = {replica: sum(1 for d in prediction.decisions if d.agent == "solver" and d.replica == replica)
                  for replica in (0, 1)}
    assert by_replica[0] == by_replica[1]  # least outstanding: the episodes start together and alternate
    homes: dict = {}
    for d in prediction.decisions:  # sticky: an episode's later turns go where its first one of the agent went
        assert homes.setdefault((d.step, d.micro_batch, d.episode, d.agent), d.replica) == d.replica
    assert {"solver/engine/0", "solver/engine/1"} <= set(prediction.busy)
    # lanes: the verifier's turn of an episode on the solver's replica index; off, least outstanding mixes them
    for lanes, same in ((True, True), (False, False)):
        config = _config(demo_config_data, replicas=2, rollout={"lanes": lanes})
        prediction = simulate(plan_placement(config, nodes), config.pipeline, _costs(episodes), nodes, steps=2)
        replica = {(d.step, d.micro_batch, d.episode, d.agent): d.replica for d in prediction.decisions}
        kept = [replica[(*key[:3], "verifier")] == index for key, index in replica.items() if key[3] == "solver"]
        assert all(kept) if same else not all(kept)


def test_more_cores_or_overlap_shorten_the_step_and_the_busiest_actor_is_named(demo_config_data: dict) -> None:
    def step(config, cpus: float) -> float:
        nodes = [{"CPU": cpus}]
        return simulate(plan_placement(config, nodes), config.pipeline, _costs(), nodes).mean_step_seconds

    streaming = _config(demo_config_data)
    assert step(streaming, 8) < step(streaming, 2)
    assert step(streaming, 2) < step(_config(demo_config_data, mode="synchronous"), 2)  # rollout k+1 beside training k
    nodes = [{"CPU": 2.0}]
    prediction = simulate(plan_placement(streaming, nodes), streaming.pipeline, _costs(), nodes)
    assert prediction.bound == max(prediction.busy, key=prediction.busy.get)
    assert 0 < prediction.busy["solver/trainer"] <= 1


def test_a_plan_that_does_not_fit_is_refused_with_the_arithmetic(demo_config_data: dict) -> None:
    data = copy.deepcopy(demo_config_data)
    data["agents"]["solver"]["engine"] = {"num_gpus": 4}
    with pytest.raises(PlacementError, match=r"need 4 GPUs .* the cluster has 2"):
        predict(parse_config(data), parse_cluster("2x8:1"), _costs())
    with pytest.raises(ValueError, match=r"no figures for agents \['verifier'\]"):
        predict(_config(demo_config_data), [{"CPU": 2.0}], Costs({"solver": ENGINE}, {"solver": TRAINER}, 0, 0, 0, 0,
                                                                  source="one agent's"))
    assert parse_cluster("48x96:8") == [{"CPU": 96.0, "GPU": 8.0}] * 48
    with pytest.raises(ValueError, match=r"expected NODESxCPUS\[:GPUS\]"):
        parse_cluster("many")


def test_the_search_moves_only_to_shorter_steps_and_names_the_settings(demo_config_data: dict) -> None:
    from marl_pipeline.planner.search import search

    data = copy.deepcopy(demo_config_data)
    data["pipeline"].update({"steps": 3})
    nodes = [{"CPU": 8.0}]
    as_written = simulate(plan_placement(parse_config(data), nodes), parse_config(data).pipeline, _costs(), nodes)
    found = search(data, nodes, lambda config: _costs())
    assert found == sorted(found, key=lambda c: c.step_seconds) and len(found) <= 5
    assert found[0].step_seconds <= as_written.mean_step_seconds
    for candidate in found:  # each is a config a launch accepts, its settings dotted as `marl train --set` takes them
        assert all("=" in setting and "." in setting.split("=")[0] for setting in candidate.settings())
    with pytest.raises(PlacementError):
        search({**data, "agents": {name: {**agent, "engine": {"num_cpus": 16}} for name, agent in
                                   data["agents"].items()}}, nodes, lambda config: _costs())


def test_gpu_costs_come_from_the_models_shapes(demo_config_data: dict, tiny_model_dir) -> None:
    from marl_pipeline.planner.plan import gpu_costs_for

    data = copy.deepcopy(demo_config_data)
    for agent in data["agents"].values():
        agent["model"] = str(tiny_model_dir)
        agent["engine"] = {"num_gpus": 1}
        agent["trainer"] = {**agent.get("trainer", {}), "num_gpus": 1}
    config = parse_config(data)
    costs = gpu_costs_for(config, "h100", _costs())
    assert costs.source.startswith("roofline on h100") and costs.episodes == _costs().episodes
    _, prediction = predict(config, parse_cluster("1x16:4"), costs, steps=2)
    assert {"solver/engine", "solver/trainer"} <= set(prediction.busy) and prediction.mean_step_seconds > 0
    with pytest.raises(ValueError, match=r"agents.solver.model 'builtin:tiny': a GPU plan reads the model's shape"):
        gpu_costs_for(parse_config(demo_config_data), "h100", _costs())


def test_an_engine_profile_replaces_the_roofline_for_its_agent(demo_config_data: dict, tiny_model_dir,
                                                               tmp_path) -> None:
    import json

    from marl_pipeline.planner.engine_profile import engine_profile
    from marl_pipeline.planner.plan import gpu_costs_for

    # step 0.01 s, 1e-4 s a sequence and 1e-7 s a sequence's context token, 2e-6 s a prompt token, fixed 0.02 s
    decode = [{"batch": b, "context": c, "step_seconds": 0.01 + b * (1e-4 + 1e-7 * c)}
              for b, c in ((8, 512), (32, 1024), (64, 2048), (16, 4096))]
    prefill = [{"tokens": t, "seconds": 0.02 + 2e-6 * t} for t in (1024, 8192)]
    path = tmp_path / "engine.json"
    path.write_text(json.dumps({"gpu": "NVIDIA H100", "model": "tiny", "decode": decode, "prefill": prefill}))
    costs = engine_profile(path, context_tokens=1024)  # a sequence at 1,024 tokens: 1e-4 + 1.024e-4
    assert (costs.step, costs.per_sequence, costs.per_prompt_token) == pytest.approx((0.01, 2.024e-4, 2e-6))

    data = copy.deepcopy(demo_config_data)
    for agent in data["agents"].values():
        agent["model"] = str(tiny_model_dir)
    config = parse_config(data)
    planned = gpu_costs_for(config, "h100", _costs(), engine_profiles={"solver": str(path)})
    assert planned.engines["solver"] == costs and planned.engines["verifier"] != costs  # the verifier's: roofline
    assert planned.source.endswith(f"engines of solver from profile {path}")
    with pytest.raises(ValueError, match=r"not agents of the experiment"):
        gpu_costs_for(config, "h100", _costs(), engine_profiles={"critic": str(path)})
    path.write_text(json.dumps({"decode": decode[:2], "prefill": prefill}))
    with pytest.raises(ValueError, match=r"needs 3 decode points"):
        engine_profile(path)
    path.write_text("{}")
    with pytest.raises(ValueError, match=r"expected JSON with decode points"):
        engine_profile(path)


@pytest.mark.launch
def test_marl_profile_engine_measures_a_profile_the_planner_fits(tiny_model_dir, tmp_path) -> None:
    """`marl profile engine` on the tiny model with bare vLLM: every decode point of a context below the limit and
    the prefill points, in the format planner/engine_profile.py fits."""
    import os
    import subprocess
    import sys

    from marl_pipeline.planner.engine_profile import engine_profile
    from tests.conftest import ROOT

    path = tmp_path / "engine.json"
    result = subprocess.run([sys.executable, "-m", "assets.cli", "profile", "engine", "--model", str(tiny_model_dir),
                             "--out", str(path), "--max-model-len", "200", "--decode-tokens", "4", "--reps", "3",
                             "--gpu-memory-utilization", "0.08"], cwd=ROOT, capture_output=True, text=True,
                            timeout=600, env={**os.environ, "COLUMNS": "200"})
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert f"written to {path}" in result.stdout
    import json

    written = json.loads(path.read_text())
    assert {(point["batch"], point["context"]) for point in written["decode"]} == {
        (batch, context) for batch in (1, 8, 32, 64) for context in (64, 128)}
    assert [point["tokens"] for point in written["prefill"]] == [199 * 5, 199 * 20, 199 * 41]
    costs = engine_profile(path)
    assert costs.step > 0 and costs.per_prompt_token > 0



def test_marl_profile_gpu_writes_what_the_planner_reads_and_refuses_a_machine_without_one(tiny_model_dir,
                                                                                        tmp_path) -> None:
    """The GPU trainer profile: this project's trainer with its defaults on an RL-shaped micro-batch, in the format
    ``trainer_profile`` reads (run here on the CPU, the one device this machine has); `marl profile gpu` itself
    refuses a machine whose torch sees no GPU, by name."""
    import json
    import os
    import subprocess
    import sys

    import torch

    from marl_pipeline.planner.profiles import GPUS, trainer_profile
    from marl_pipeline.planner.profiling import gpu_trainer, synthetic_batch
    from tests.conftest import ROOT

    batch = synthetic_batch(rows=4, vocab=50, prompt_tokens=(4, 8), response_tokens=(2, 6))
    found = gpu_trainer(tiny_model_dir, device="cpu", repeats=1, batch=batch, progress=lambda line: None)
    run = found["runs"][0]
    tokens = sum(len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids))
    assert found["tokens"] == tokens and found["peak_tflops"] > 0 and run["variant"] == "default"
    assert run["mfu"] == pytest.approx(6 * run["parameters"] * tokens / run["seconds"] / (found["peak_tflops"] * 1e12))
    path = tmp_path / "trainer.json"
    path.write_text(json.dumps(found))
    stated = GPUS["h100"]
    assert trainer_profile(path, gpu=stated) == pytest.approx(run["mfu"] * found["peak_tflops"] / stated.bf16_tflops)
    if torch.cuda.is_available():
        return
    result = subprocess.run([sys.executable, "-m", "assets.cli", "profile", "gpu", "--model", str(tiny_model_dir),
                             "--out", str(tmp_path / "refused.json")], cwd=ROOT, capture_output=True, text=True,
                            timeout=300, env={**os.environ, "COLUMNS": "200"})
    assert result.returncode == 2 and "measures a CUDA GPU" in result.stdout, result.stdout + result.stderr
    assert not (tmp_path / "refused.json").exists()

def test_the_calibration_counts_the_cores_a_trainer_call_had_and_a_swapped_workers_calls_in_turn() -> None:
    """Three one-thread trainers on 2 cores take a micro-batch's calls at once: each call had 2/3 of a core, so its
    seconds are 2/3 core-seconds; two agents on one swapped worker take theirs in turn, so the train stage's span
    beyond its calls is its span less their sum, not less the longest one."""
    import pyarrow as pa

    from marl_pipeline.planner.costs import _train_overhead
    from marl_pipeline.planner.threads import AgentThreads, ThreadScaling, core_shares

    def updates(rows: list[tuple]) -> pa.Table:
        step, mb, agent, started, ended, seconds = zip(*rows)
        stamp = pa.timestamp("us", tz="UTC")
        return pa.table({"step": step, "micro_batch": mb, "agent": agent,
                         "stage_started": pa.array([int(t * 1e6) for t in started], stamp),
                         "stage_ended": pa.array([int(t * 1e6) for t in ended], stamp), "compute_seconds": seconds})

    resident = {agent: AgentThreads(1, 1, 1, f"{agent}/trainer", True) for agent in ("a", "b", "c")}
    table = updates([(0, 0, agent, 10.0, 10.5, 0.3) for agent in "abc"] + [(0, 1, "a", 11.0, 11.2, 0.1)])
    assert core_shares(table, resident, cores=2.0) == {(0, 0): pytest.approx(2 / 3), (0, 1): 1.0}
    assert core_shares(table, resident, cores=None) == {}
    crowded = core_shares(table, resident, cores=2.0, scaling=ThreadScaling(crowding=0.5))  # as the cores charge it
    assert crowded == {(0, 0): pytest.approx((2 / 3) ** 1.5), (0, 1): 1.0}
    on_gpus = {agent: AgentThreads(1, 1, 1, f"{agent}/trainer", False) for agent in "abc"}
    assert core_shares(table, on_gpus, cores=2.0) == {}  # a GPU trainer's call does not share the node's cores
    swapped = {agent: AgentThreads(1, 1, 1, "trainer-worker-0", True) for agent in "ab"}
    two = updates([(0, 0, "a", 10.0, 10.5, 0.2), (0, 0, "b", 10.0, 10.5, 0.2)])
    assert core_shares(two, swapped, cores=2.0) == {(0, 0): 1.0}  # one worker: one thread set
    assert _train_overhead(two, swapped) == pytest.approx(0.1, abs=1e-6)
    assert _train_overhead(two, {agent: AgentThreads(1, 1, 1, f"{agent}/trainer", True) for agent in "ab"}) == (
        pytest.approx(0.3, abs=1e-6))


def _replica(env: simpy.Environment, costs: EngineCosts):
    """A simulated engine replica of one thread on a core of its own."""
    from marl_pipeline.cluster.specs import ActorSpec
    from marl_pipeline.planner.replica import Busy, EngineReplica

    spec = ActorSpec("solver/engine", "engine", "solver", 0, cpus=1.0, gpus=0.0)
    return EngineReplica(env, spec, costs, (SharedCores(env, 1), False), Busy(env), simpy.Resource(env, 1))


def test_a_step_s_finished_requests_are_returned_together_after_their_own_work() -> None:
    """Two requests of one token taken in together finish in one step (1 s); their own work (0.25 s each) is done on
    the engine's thread before the step's results go back in one chunk (as ``generate_stream`` yields them), so both
    come back at 1.5 s, and the next step waits for it."""
    env = simpy.Environment()
    engine = _replica(env, EngineCosts(step=1.0, per_sequence=0.0, per_prompt_token=0.0, per_request=0.25))
    returned: list[float] = []

    def request(tokens: int):
        yield engine.generate(Turn("solver", 4, tokens), 0)
        returned.append(env.now)

    for tokens in (1, 1, 2):
        env.process(request(tokens))
    env.run()
    assert returned == pytest.approx([1.5, 1.5, 2.75])  # the third's second step starts once both are returned


def test_a_reload_waits_for_the_requests_in_flight_and_holds_the_ones_after_it() -> None:
    """As the engine's loop (inference/async_engine.py): a weight sync asked for while a request decodes waits until
    it is done (on the old version); a request sent meanwhile waits for the reload and samples the new one."""
    env = simpy.Environment()
    engine = _replica(env, EngineCosts(step=1.0, per_sequence=0.0, per_prompt_token=0.0))
    done: dict[str, tuple[float, int]] = {}

    def request(name: str, at: float, tokens: int):
        yield env.timeout(at)
        version = yield engine.generate(Turn("solver", 4, tokens), 0)
        done[name] = (env.now, version)

    def sync(at: float):
        yield env.timeout(at)
        yield engine.sync(0.5, 1)
        done["sync"] = (env.now, 1)

    env.process(request("in flight", 0.0, 3))  # steps end at 1, 2, 3
    env.process(sync(0.5))
    env.process(request("after the sync", 0.6, 1))
    env.run()
    assert done["in flight"] == (3.0, 0)  # not cut by the reload: it finishes on version 0
    assert done["sync"] == (3.5, 1)  # the reload, once nothing runs
    assert done["after the sync"] == (4.5, 1)  # held until then, then one step on version 1


def test_an_engine_step_is_fitted_as_fixed_and_per_sequence_from_its_requests_finishing() -> None:
    """A wave's requests taken in together share each step while they decode, so one that ends early was charged
    bigger shares of fewer steps: from their engine seconds, a step's a + b x sequences comes back. A wave whose
    requests all end together cannot tell a from b: its step is taken as fixed."""
    import pyarrow as pa

    from marl_pipeline.planner.costs import _engine_costs

    def rollouts(waves: list[list[int]], a: float, b: float, staggered: int = 0) -> pa.Table:
        """Each wave's requests sent together at its start, and ``staggered`` more in a second turn sent one by one
        (0.1 s apart, each alone in the engine: 3 steps, 0.004 s of its own work, a reply of 0.05 s)."""
        rows = []
        for index, lengths in enumerate(waves):
            decoding = [sum(length >= k for length in lengths) for k in range(1, max(lengths) + 1)]
            for length in lengths:
                seconds = sum((a + b * n) / n for n in decoding[:length])
                rows.append({"step": index, "micro_batch": 0, "turn": 0, "agent": "solver",
                             "response_ids": [1] * length, "engine_seconds": seconds, "observe_seconds": None,
                             "rollout_start": index * 10.0, "rollout_end": index * 10.0 + sum(
                                 a + b * n for n in decoding) + 0.001 * len(lengths)})
            for k in range(staggered):
                sent = index * 10.0 + 5.0 + 0.1 * k
                rows.append({"step": index, "micro_batch": 0, "turn": 1, "agent": "solver", "response_ids": [1] * 3,
                             "engine_seconds": 3 * (a + b), "observe_seconds": 0.05,
                             "rollout_start": sent, "rollout_end": sent + 3 * (a + b) + 0.004 + 0.05})
        stamp = pa.timestamp("us", tz="UTC")
        table = pa.Table.from_pylist(rows)
        return table.set_column(table.schema.get_field_index("rollout_start"), "rollout_start", pa.array(
            [int(t * 1e6) for t in table["rollout_start"].to_pylist()], stamp)).set_column(
            table.schema.get_field_index("rollout_end"), "rollout_end", pa.array(
                [int(t * 1e6) for t in table["rollout_end"].to_pylist()], stamp))

    varied = [[1, 2, 2, 3, 5, 8] * 8, [1, 1, 4, 6] * 10]
    fitted = _engine_costs(rollouts(varied, a=0.01, b=0.0005, staggered=6), "solver", threads=2, busy=[])
    assert (fitted.step, fitted.per_sequence) == pytest.approx((0.02, 0.001), rel=1e-3)  # core-seconds: x 2 threads
    # a request's own work, by its turn: the first turns' wave's span beyond its steps, a request; the second turn's
    # requests one by one, their time in flight (replies and the gaps between them left out) beyond their steps
    assert fitted.per_request_by_turn == pytest.approx((0.002, 0.008), rel=1e-2)
    assert (fitted.request(0), fitted.request(1), fitted.request(5)) == pytest.approx(
        (0.002, 0.008, fitted.per_request), rel=1e-3)
    alike = _engine_costs(rollouts([[3] * 16], a=0.01, b=0.0005), "solver", threads=1, busy=[])
    assert (alike.step, alike.per_sequence) == pytest.approx((0.01 + 16 * 0.0005, 0.0))


def test_the_driver_computes_beside_the_turns_and_a_reply_holds_its_episode(demo_config_data: dict) -> None:
    """The driver's CPU per turn takes a thread of the head node's cores, so on cores the actors fill it lengthens
    the step, on idle ones not; an environment's reply delays its episode's next turn by its seconds."""
    from dataclasses import replace

    config = _config(demo_config_data)

    def step(costs: Costs, cpus: float) -> tuple[float, dict]:
        nodes = [{"CPU": cpus}]
        prediction = simulate(plan_placement(config, nodes), config.pipeline, costs, nodes, steps=2)
        return prediction.mean_step_seconds, prediction.busy

    alone, busy = step(_costs(), 2.0)
    assert busy["driver"] == 0
    driven, busy = step(replace(_costs(), driver_per_turn=0.002), 2.0)
    assert driven > alone and 0 < busy["driver"] < 1
    assert step(replace(_costs(), driver_per_turn=0.002), 64.0)[0] == pytest.approx(step(_costs(), 64.0)[0], rel=0.02)
    replied = [[Turn("solver", 40, 4, observe_seconds=0.3), Turn("verifier", 60, 2)]] * 64
    slow = simulate(plan_placement(config, [{"CPU": 2.0}]), config.pipeline, _costs(replied), [{"CPU": 2.0}], steps=2)
    first = {(d.step, d.micro_batch, d.episode): d for d in slow.decisions if d.turn == 0}
    for d in slow.decisions:
        if d.turn == 1:
            assert d.started >= first[(d.step, d.micro_batch, d.episode)].ended + 0.3 - 1e-9


def test_each_hand_off_between_stages_and_to_the_publisher_waits_the_calibrated_seconds(demo_config_data: dict) -> None:
    """With one micro-batch a step at staleness 0, a step's micro-batch is handed on four times in a row (rollout to
    environment, to reward, to training, to each agent's publisher), so each hand-off's seconds lengthen the step
    four times over."""
    from dataclasses import replace

    config = _config(demo_config_data, micro_batches_per_step=1)
    nodes = [{"CPU": 2.0}]

    def step(costs: Costs) -> list[float]:
        return simulate(plan_placement(config, nodes), config.pipeline, costs, nodes, steps=3).step_seconds

    for before, after in zip(step(_costs())[1:], step(replace(_costs(), handoff=0.25))[1:]):
        assert after - before == pytest.approx(4 * 0.25, abs=1e-6)


def test_a_publisher_holds_its_trainer_for_the_optimizer_step_and_not_the_engines_sync(demo_config_data: dict) -> None:
    """One trainer worker serving both agents (swapped) runs each agent's optimizer step in turn, but the engines
    load the exported weights without it: two agents' syncs, each on its own engine, overlap, so a second longer
    lengthens the step by about a second, not two."""
    from dataclasses import replace

    data = copy.deepcopy(demo_config_data)
    data["ray"] = {**data.get("ray", {}), "resident_trainers": 1}
    data["pipeline"].update({"steps": 3, "micro_batches_per_step": 1})
    config, nodes = parse_config(data), [{"CPU": 64.0}]
    plan = plan_placement(config, nodes)
    assert [spec.loads for spec in plan.specs if spec.role == "trainer-worker"] == [("solver", "verifier")]

    def step(sync: float) -> list[float]:
        trainer = replace(TRAINER, sync_per_replica=sync)
        costs = replace(_costs(), trainers={"solver": trainer, "verifier": trainer})
        return simulate(plan, config.pipeline, costs, nodes).step_seconds

    for before, after in zip(step(0.05)[1:], step(1.05)[1:]):
        assert after - before == pytest.approx(1.0, abs=0.05)


def test_the_hand_off_is_fitted_from_when_each_stage_could_start_to_when_it_did() -> None:
    """Of each step's last micro-batch (the one a synchronous step's barrier waits for), from its previous stage's
    end, or for training also from the previous micro-batch's training end (one train thread), to its start; and
    from the step's last training to each publisher's start; the median of those."""
    from marl_pipeline.planner.costs import _handoff
    from marl_pipeline.run.pipeline_metrics import Span

    def chain(step: int, mb: int, at: float, gaps: tuple[float, float, float]) -> list[Span]:
        spans, t = [], at
        for stage, gap in zip(("rollouts", "environment_results", "rewards", "policy_updates"), (0.0, *gaps)):
            t += gap
            spans.append(Span(stage, step, mb, t, t, t + 1.0))
            t += 1.0
        return spans

    # micro-batch 0's hand-offs (9 s: a barrier's wait) are not counted; micro-batch 1's training waits for
    # micro-batch 0's (ending at 31), not for its reward (ending at 22.1)
    spans = chain(0, 0, 0.0, (9.0, 9.0, 9.0)) + chain(0, 1, 19.0, (0.05, 0.05, 0.0))
    spans[-1] = Span("policy_updates", 0, 1, 22.1, 31.2, 32.2)
    spans += [Span("optimizer_step", 0, -1, 32.2, 32.3, 33.0), Span("optimizer_step", 0, -1, 32.2, 32.5, 33.0)]
    assert _handoff(spans) == pytest.approx(0.1)  # of 0.05, 0.05, 0.2 (31 to 31.2), 0.1 and 0.3
    assert _handoff([]) == 0.0


def test_several_launches_calibrate_as_the_mean_of_their_figures_and_their_episodes_in_turn() -> None:
    """A shared host runs one launch faster than the next: pooled costs average each figure, turn by turn where a
    figure is by the turn, and draw the launches' episodes alternately (a simulation shorter than one launch sees
    both)."""
    fast = Costs({"solver": EngineCosts(0.01, 1e-4, 0.0, 2e-4, (2e-4, 4e-4))}, {"solver": TRAINER}, environment=0.04,
                 reward=0.05, rollout_overhead=0.1, train_overhead=0.05, episodes=[[Turn("solver", 3, 2)]] * 2,
                 source="a", driver_per_turn=1e-4)
    slow = Costs({"solver": EngineCosts(0.03, 3e-4, 0.0, 4e-4, (4e-4, 8e-4))},
                 {"solver": TrainerCosts(0.3, 1e-4, 0.02, 0.06, 0.001)}, environment=0.08, reward=0.05,
                 rollout_overhead=0.1, train_overhead=0.05, episodes=[[Turn("solver", 5, 4)]] * 2, source="b",
                 driver_per_turn=3e-4)
    both = pooled([fast, slow])
    engine, trainer = both.engines["solver"], both.trainers["solver"]
    assert (engine.step, engine.per_sequence, engine.per_request) == pytest.approx((0.02, 2e-4, 3e-4))
    assert engine.per_request_by_turn == pytest.approx((3e-4, 6e-4))
    assert (trainer.call, trainer.sync_per_replica) == pytest.approx(((TRAINER.call + 0.3) / 2,
                                                                      (TRAINER.sync_per_replica + 0.06) / 2))
    assert (both.environment, both.driver_per_turn) == pytest.approx((0.06, 2e-4))
    assert [episode[0].prompt_tokens for episode in both.episodes] == [3, 5, 3, 5]
    assert both.source == "a; b"
    with pytest.raises(ValueError, match=r"cannot pool costs of different agents: a has \['solver'\]"):
        pooled([fast, _costs()])
    with pytest.raises(ValueError, match="no stored run to take costs from"):
        pooled([])


def test_the_prediction_counts_the_core_seconds_it_charges_by_kind_of_work(demo_config_data: dict) -> None:
    """What the simulation charged the nodes' cores a step, by kind, is what its costs say the step's work takes: the
    trainers' calls by their tokens, the driver's CPU by its turns (so a measured process's CPU can be set beside
    it)."""
    from dataclasses import replace

    config = _config(demo_config_data)
    pipeline, nodes = config.pipeline, [{"CPU": 2.0}]
    costs = replace(_costs(), driver_per_turn=0.002)
    prediction = simulate(plan_placement(config, nodes), pipeline, costs, nodes, steps=3)
    episodes = pipeline.prompts_per_micro_batch * pipeline.samples_per_prompt * pipeline.micro_batches_per_step
    calls = 2 * pipeline.micro_batches_per_step  # two agents, a call each a micro-batch
    trained = TRAINER.call * calls + TRAINER.per_token * episodes * (40 + 4 + 60 + 2)
    assert prediction.core_seconds["trainers"] == pytest.approx(trained)
    assert prediction.core_seconds["driver"] == pytest.approx(0.002 * 2 * episodes)
    assert prediction.core_seconds["engines"] > 0 and set(prediction.core_seconds) == {"engines", "trainers", "driver"}


def test_the_measured_step_is_the_launchs_own_step_end_and_before_it_was_stored_the_last_trained_micro_batch(
        tmp_path) -> None:
    """``marl plan``'s measured step (beside every prediction): from each step's ``step_finished`` (when the launch
    finished it, as its StepFinished said) where the launch stored them; from its last trained micro-batch where it
    did not (stored before schema 13, or finished by an earlier launch)."""
    from datetime import UTC, datetime

    import pyarrow as pa

    from marl_pipeline.planner.plan import measured_step_seconds
    from marl_pipeline.store import ExperienceStore, MicroBatchKey
    from marl_pipeline.store.schema import HEALTH, STAGE_SCHEMAS, with_agent

    started = 1_800_000_000.0
    launch = {"first_step": 0, "last_step": 2, "started_at": datetime.fromtimestamp(started, UTC).isoformat()}

    def updates(store: ExperienceStore, trained: list[float]) -> ExperienceStore:
        for step, ended in enumerate(trained):  # each step's last micro-batch trained
            row = {"agent": "solver", "policy_version": step, "rows": 4, "tokens": 40, "loss_sum": 0.0,
                   "clip_fraction": 0.0, "mean_ratio": 1.0, "status": "ok", "error": None,
                   **{name: int(ended * 1e6) for name in ("stage_enqueued", "stage_started", "stage_ended")}}
            schema = with_agent(STAGE_SCHEMAS["policy_updates"])
            store.commit("policy_updates", MicroBatchKey("r", step, 0), pa.Table.from_pylist([row], schema=schema))
        return store

    # Stored before step_finished, step 0 trained by an earlier launch (killed before it finished the step): left out
    earlier = updates(ExperienceStore(tmp_path / "earlier"), [started - 5, started + 12, started + 15])
    assert measured_step_seconds(earlier, "r", launch) == (3.0, 1, 2)
    store = updates(ExperienceStore(tmp_path / "store"), [started + 10, started + 12, started + 15])

    def health(ends: list[float | None]) -> None:
        for step, finished in enumerate(ends):
            row = {"agent": "solver", "policy_version": step + 1, "groups": 4,
                   "step_finished": None if finished is None else int(finished * 1e6)}
            table = pa.Table.from_pylist([row], schema=pa.schema([pa.field("agent", pa.string()), *HEALTH]))
            store.commit("health", MicroBatchKey("r", step, 0), table)

    health([None, None, None])  # stored before step_finished
    assert measured_step_seconds(store, "r", launch) == (2.5, 0, 2)
    health([started - 5, started + 13, started + 17.5])  # step 0 finished by an earlier launch: left out
    assert measured_step_seconds(store, "r", launch) == (4.5, 1, 2)
    health([started + 11, started + 13, started + 17])
    assert measured_step_seconds(store, "r", launch) == (3.0, 0, 2)
