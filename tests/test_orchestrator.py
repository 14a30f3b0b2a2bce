"""The joint orchestrator on real Ray, vLLM and torch: consistency, staleness bound, kill-and-resume."""

from __future__ import annotations

import gc
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.compute as pc
import pytest
import torch
import yaml
from safetensors.torch import load_file

from marl_pipeline.cluster import warm_actors
from marl_pipeline.config import HealthConfig, parse_config
from marl_pipeline.run.events import (
    LayoutChanged,
    PolicyCommitted,
    RunFinished,
    RunStarted,
    StepFinished,
    TrainerPasses,
    describe_passes,
)
from marl_pipeline.run.layouts import stored_layouts
from marl_pipeline.run.recipe import train
from marl_pipeline.stages.health import collapse_warnings, recent_health
from marl_pipeline.store import ExperienceStore, MicroBatchKey
from marl_pipeline.store.schema import STAGES
from tests.conftest import ROOT, actor_classes, hybrid_agents, small_config_data
from tests.three_agents import CLI

pytestmark = pytest.mark.launch
SHARES_WARM_ACTORS = True  # its launches take the engines and trainers the module before kept (conftest)
MARL = (sys.executable, "-m", "assets.cli")  # the `marl` command of this environment

# Streaming with staleness 0 and the synchronous pipeline see the same samples (seeded per request)
# and accumulate them in the same order, so their parameters agree to float32 rounding.
PARAMETER_TOLERANCE = 1e-6


def _sharded_data(demo_config_data: dict, store: Path, **pipeline) -> dict:
    """The small demo with the solver trained on 2 workers (FSDP2 over gloo, training/sharded.py), new weights
    broadcast from the trainers to the engines (policy/transfer.py), a checkpoint every 2 versions (and at a
    launch's end)."""
    data = small_config_data(demo_config_data, store, **{"checkpoint_every": 2, **pipeline})
    data["agents"]["solver"].setdefault("trainer", {})["workers"] = 2
    data["ray"]["weight_sync"] = "broadcast"
    return data


def _run(config) -> list:
    return list(train(config))


def _weights(store: ExperienceStore, run: str, agent: str, version: int) -> dict:
    return load_file(store.policy_dir(run, agent, version) / "model.safetensors")


@pytest.fixture(scope="module")
def uninterrupted(local_ray, demo_config_data, tmp_path_factory) -> ExperienceStore:
    """One launch of 4 steps x 2 micro-batches, the solver on 2 workers, never interrupted: what the resumed
    launches below must end equal to (run once for the module, as each run costs engines and trainers)."""
    config = parse_config(_sharded_data(demo_config_data, tmp_path_factory.mktemp("uninterrupted") / "store",
                                        steps=4, micro_batches_per_step=2))
    _run(config)
    store = ExperienceStore(config.store)
    # Every version the engines sampled with is the one the trainers hold (staleness 0): the broadcast carried it.
    updates = store.read_stage("demo", "policy_updates", columns=["step", "mismatch_abs_logprob"]).to_pylist()
    assert {row["step"] for row in updates} == {0, 1, 2, 3}
    assert max(row["mismatch_abs_logprob"] for row in updates) < 1e-5, updates
    # A run that learns, read as the collapse warnings read it: nothing to report.
    assert collapse_warnings(recent_health(store, "demo", 3, 3), HealthConfig()) == []
    return store


def test_streaming_s0_ends_with_the_synchronous_parameters(local_ray, demo_config_data, tmp_path: Path) -> None:
    results = {}
    for mode in ("synchronous", "streaming"):
        config = parse_config(small_config_data(demo_config_data, tmp_path / mode, steps=3, micro_batches_per_step=3,
                                                mode=mode, staleness=0))
        events = _run(config)
        assert isinstance(events[-1], RunFinished)
        assert [e.step for e in events if isinstance(e, StepFinished)] == [0, 1, 2]
        results[mode] = ExperienceStore(config.store)
        # What holds the next rollout is the engine sync alone: each version's record says how long it took, within
        # the publisher's time on the version, which goes on to the checkpoint's save and commit after it.
        committed = [e for e in events if isinstance(e, PolicyCommitted)]
        assert len(committed) == 6 and all(0 < e.sync_seconds < e.timing.ended - e.timing.started for e in committed)
        assert all(e.computed_tokens > e.tokens and e.tokens_per_second > 0 and 0 < e.mfu < 1 for e in committed)
        kept = [e for e in committed if e.version in results[mode].policy_versions("demo", e.agent)]  # retention
        for event in kept:
            record = json.loads(results[mode].checkpoints.read_file("demo", event.agent, event.version, "timing.json"))
            assert record["sync_seconds"] == pytest.approx(event.sync_seconds)
            assert record["mfu"] == event.mfu and record["tokens_per_second"] == event.tokens_per_second
            assert record["passes"] == "padded" and record["chunk_tokens"] > 0 and record["peak_tflops"] > 0
        assert kept
        # Each trainer's passes told once, with its first step; its figures in every step's health.
        told = [e for e in events if isinstance(e, TrainerPasses)]
        assert sorted((e.agent, e.step) for e in told) == [("solver", 0), ("verifier", 0)]
        assert all(e.settings["chunk_tokens"] > 0 and e.settings["padded_why"] for e in told)
        assert describe_passes(told)[0].startswith("trainers of solver, verifier: padded passes of "), told
        steps = [e for e in events if isinstance(e, StepFinished)]
        assert all(signals["trainer_tokens_per_s"] > 0 and 0 < signals["mfu"] < 1
                   for e in steps for signals in e.health.values())
    for agent in ("solver", "verifier"):
        synchronous = _weights(results["synchronous"], "demo", agent, 3)
        streaming = _weights(results["streaming"], "demo", agent, 3)
        base = _weights(results["streaming"], "demo", agent, 0)
        worst = max((synchronous[name] - streaming[name]).abs().max().item() for name in synchronous)
        assert worst <= PARAMETER_TOLERANCE, agent
        assert max((streaming[n] - base[n]).abs().max().item() for n in base) > 1e-4  # training happened


def test_staleness_1_never_trains_on_older_samples(local_ray, demo_config_data, tmp_path: Path) -> None:
    config = parse_config(small_config_data(demo_config_data, tmp_path / "store", steps=4, micro_batches_per_step=2,
                                            staleness=1))
    frozen_before, frozen = gc.get_freeze_count(), []
    steps = []
    for event in train(config):
        if isinstance(event, StepFinished):
            steps.append(event)
            frozen.append(gc.get_freeze_count())
    # While it streams, the launch's start-up heap is out of the collector's reach; after, back in it.
    assert min(frozen) > frozen_before and gc.get_freeze_count() == frozen_before, (frozen_before, frozen)
    # Step time runs from one step's end to the next; a step's span from its first rollout, which at staleness 1
    # comes before the previous step ends: the spans overlap, the step times add up to the launch.
    assert [step.step for step in steps] == [0, 1, 2, 3]
    assert steps[0].seconds == steps[0].span_seconds
    assert all(step.span_seconds > step.seconds > 0 for step in steps[2:]), steps
    store = ExperienceStore(config.store)
    rollouts = store.read_stage("demo", "rollouts", columns=["step", "policy_version", "agent"])
    staleness = pc.subtract(rollouts.column("step"), rollouts.column("policy_version")).to_pylist()
    assert rollouts.num_rows and min(staleness) >= 0 and max(staleness) <= 1
    updates = store.read_stage("demo", "policy_updates", columns=["step", "policy_version", "agent"])
    # a trainer takes step i's gradient at version i: samples trained are at most 1 version older
    assert pc.all(pc.equal(updates.column("step"), updates.column("policy_version"))).as_py()
    assert store.policy_versions("demo", "solver") == [0, 3, 4]  # store.retention's defaults: 0 and the last 2


def test_a_dead_trainer_stops_the_launch_before_anything_is_sampled_past_the_staleness_gate(
        local_ray, demo_config_data, tmp_path: Path) -> None:
    """A trainer process killed (as the OOM killer would) after step 0 stops the launch with Ray's error. Rollout,
    waiting at the gate for version 2, is released by the stop and must not sample step 2 with version 1 on its
    way out: it did, and a relaunch then resumed from rollouts older than the staleness bound allows."""
    import ray

    config = parse_config(small_config_data(demo_config_data, tmp_path / "store", steps=4, micro_batches_per_step=2))
    frozen_before = gc.get_freeze_count()
    with pytest.raises(ray.exceptions.RayActorError):
        for event in train(config):
            if isinstance(event, StepFinished) and event.step == 0:
                trainers = [actor["Pid"] for actor in ray._private.state.actors(actor_state_name="ALIVE").values()
                            if actor["ActorClassName"].endswith("Trainer")]
                os.kill(trainers[0], signal.SIGKILL)
    rollouts = ExperienceStore(config.store).read_stage("demo", "rollouts", columns=["step", "policy_version"])
    served = set(zip(rollouts.column("step").to_pylist(), rollouts.column("policy_version").to_pylist()))
    assert served <= {(0, 0), (1, 1)}, served  # step 2 needs version 2, which the dead trainer never made
    assert warm_actors.idle_count() == 0  # a failed launch keeps none of its actors (ray.keep_actors is on)
    assert gc.get_freeze_count() == frozen_before  # nor leaves its heap frozen


def test_two_launches_end_with_the_parameters_of_one_adamw_included(uninterrupted, demo_config_data,
                                                                   tmp_path) -> None:
    config = parse_config(_sharded_data(demo_config_data, tmp_path / "two", steps=2, micro_batches_per_step=2))
    for _ in range(2):  # the second launch continues from version 2, its AdamW state restored from the checkpoint
        before = set(actor_classes())
        _run(config)
        started = [name for actor_id, name in actor_classes().items() if actor_id not in before]
        # the solver's 2 ranks, kept from the launch before (ray.keep_actors): restarted in place, meeting again
        assert "ShardedTrainer" not in started, started
    two = ExperienceStore(config.store)
    for agent in ("solver", "verifier"):
        straight, resumed = _weights(uninterrupted, "demo", agent, 4), _weights(two, "demo", agent, 4)
        assert max((straight[n] - resumed[n]).abs().max().item() for n in straight) <= PARAMETER_TOLERANCE, agent


def test_a_new_layout_by_length_resumes_the_launch_in_it_after_the_step_once(uninterrupted, demo_config_data,
                                                                           tmp_path: Path) -> None:
    """EARL at run time (run/layouts.py): the solver starts on 1 trainer worker; its turns in step 0 reach the
    length of its entry for 2 workers, so the launch ends after step 0 (checkpointed) and the next one resumes it at
    step 1 on 2 workers. Every micro-batch once, the launch record's history as a resumed launch's, and the
    parameters those of the run on 2 workers throughout up to the reduction order of one worker's step 0."""
    data = _sharded_data(demo_config_data, tmp_path / "store", steps=4, micro_batches_per_step=2)
    data["agents"]["solver"]["trainer"]["workers"] = 1
    data["agents"]["solver"]["parallelism_by_length"] = [{"from_tokens": 1, "trainer_workers": 2}]
    config = parse_config(data)
    events = _run(config)
    changed = [event for event in events if isinstance(event, LayoutChanged)]
    assert [(event.step, event.changed) for event in changed] == [
        (0, {"solver": ("tensor parallel 1, 1 trainer worker", "tensor parallel 1, 2 trainer workers")})]
    assert changed[0].lengths["solver"] > 1 and set(changed[0].lengths) == {"solver", "verifier"}
    started = [event for event in events if isinstance(event, RunStarted)]
    assert [len(event.placement.agent_specs("solver", "trainer")) for event in started] == [1, 2]
    assert [event.step for event in events if isinstance(event, StepFinished)] == [0, 1, 2, 3]
    # The call's report covers both launches: from the first one's plan and start.
    assert isinstance(events[-1], RunFinished) and events[-1].plan == started[0].plan
    store = ExperienceStore(config.store)
    assert_every_micro_batch_once(store, 4, 2, checkpoint_every=2)
    record = store.read_record("demo", "launch.json")
    assert [(launch["first_step"], record["configs"][launch["config"]]["agents"]["solver"]["trainer"]["workers"])
            for launch in record["launches"]] == [(0, 1), (1, 2)]
    # A later launch starts in the layout the last step's rollouts call for, read from the store.
    assert stored_layouts(store, config, 3) == {"solver": 0} and stored_layouts(store, config, -1) == {}
    # The parameters of the run on 2 workers throughout, but for the order in which one worker's step 0 summed its
    # gradient: 1.4e-5 after 4 steps that moved them by 4e-3 (an AdamW state lost at the restart would differ by
    # about the learning rate, 1e-3). Its AdamW state went on through the restart: 4 steps, the same moments.
    for agent, tolerance in (("solver", 1e-4), ("verifier", PARAMETER_TOLERANCE)):
        straight, relaid = _weights(uninterrupted, "demo", agent, 4), _weights(store, "demo", agent, 4)
        assert max((straight[n] - relaid[n]).abs().max().item() for n in straight) <= tolerance, agent
    moments = [torch.load(run.policy_dir("demo", "solver", 4) / "trainer_state.pt")["optimizer"]["state"]
               for run in (uninterrupted, store)]
    for index, state in moments[0].items():
        assert int(state["step"]) == int(moments[1][index]["step"]) == 4
        torch.testing.assert_close(moments[1][index]["exp_avg_sq"], state["exp_avg_sq"], rtol=1e-3, atol=1e-12)


def assert_every_micro_batch_once(store: ExperienceStore, steps: int, micro_batches: int,
                                  checkpoint_every: int = 1, agents: tuple[str, ...] = ("solver", "verifier"),
                                  turns: int = 2) -> None:
    """A resumed run of the small demo holds exactly an uninterrupted one's partitions, versions and record."""
    expected = [MicroBatchKey("demo", s, m) for s in range(steps) for m in range(micro_batches)]
    for stage in STAGES:
        assert store.committed_keys("demo", stage) == expected, stage
    rollouts = store.read_stage("demo", "rollouts", columns=["sample_id", "step", "micro_batch", "status"])
    sample_ids = rollouts.column("sample_id").to_pylist()
    kept = [sample_id for sample_id, status in zip(sample_ids, rollouts.column("status").to_pylist())
            if status != "dropped"]  # over-sampling's dropped turns are stored too
    assert len(sample_ids) == len(set(sample_ids)) and len(kept) == steps * micro_batches * 4 * 4 * turns
    assert store.checkpoints.agents("demo") == sorted(agents)
    for agent in agents:  # retention: 0 and the last 2 committed
        assert store.policy_versions("demo", agent) == [0, steps - checkpoint_every, steps]
    record = store.read_record("demo", "launch.json")
    assert (record["last_step"], record["finished"]) == (steps - 1, True)
    # Its history: the first launch, each later one resuming it at the same target, the last one finishing.
    launches = record["launches"]
    assert [launch["resumed"] for launch in launches] == [False] + [True] * (len(launches) - 1), launches
    assert [launch["finished"] for launch in launches] == [False] * (len(launches) - 1) + [True], launches
    assert {launch["last_step"] for launch in launches} == {steps - 1}


def _committed(store: ExperienceStore) -> int:
    return sum(len(store.committed_keys("demo", stage)) for stage in STAGES)


def _launch(config_path: Path, cwd: Path, *settings: str, marl: tuple[str, ...] = MARL) -> subprocess.Popen:
    warm_actors.stop_idle()  # a launch of its own process and Ray: the kept actors would only hold memory
    env = {**os.environ, "DAGSTER_HOME": str(cwd / "dagster_home"), "PYTHONPATH": str(ROOT)}
    command = [*marl, "train", str(config_path), *[f"--set={s}" for s in settings]]
    return subprocess.Popen(command, cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def kill_after_commits(config_path: Path, cwd: Path, store: ExperienceStore, target: int, *settings: str,
                       marl: tuple[str, ...] = MARL) -> None:
    """Launch ``marl train`` and kill its process group (SIGKILL) once ``target`` partitions are committed, at
    whatever the run is doing then (or once it ended)."""
    process = _launch(config_path, cwd, *settings, marl=marl)
    deadline = time.monotonic() + 300
    while _committed(store) < target and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def test_killed_twice_and_resumed_commits_every_micro_batch_once(uninterrupted, demo_config_data,
                                                                tmp_path: Path) -> None:
    steps, micro_batches = 4, 2
    data = _sharded_data(demo_config_data, tmp_path / "store", steps=steps, micro_batches_per_step=micro_batches)
    config_path = tmp_path / "experiment.yaml"
    config_path.write_text(yaml.safe_dump(data))
    store = ExperienceStore(data["store"])
    total = steps * micro_batches * len(STAGES)
    # Kill before the last micro-batch's partitions: once the count reached a later target, the run's last few
    # commits (environment results and rewards land milliseconds apart) could all land before the kill, leaving
    # nothing to resume (seen once in CI: 32 of 32 committed after the third kill).
    # Twice: the second kill lands in a launch that resumed (a third did the same again, for 40 s of the suite).
    kill_points = sorted(random.Random(os.getpid()).sample(range(1, total - len(STAGES)), 2))
    for target in kill_points:
        kill_after_commits(config_path, tmp_path, store, target)
    before = _committed(store)
    assert before < total
    # What a killed launch may leave half-written (whether these kills did depends on their timing), and another
    # run's staging, which may be a live writer's: the resuming launch removes the first, never the second.
    attempt = f"{time.time_ns() - 10**10:016x}-0000dead"
    dead = [tmp_path / "store" / "run=demo" / "stage=rewards" / "step=0" / f"_staging-micro_batch=0-{attempt}",
            tmp_path / "store" / "run=demo" / "policies" / "agent=solver" / f"_staging-version=9-{attempt}"]
    alive = tmp_path / "store" / "run=other" / "stage=rewards" / "step=0" / f"_staging-micro_batch=0-{attempt}"
    for directory in [*dead, alive]:
        directory.mkdir(parents=True)
        (directory / "part.parquet").write_bytes(b"half")
    process = _launch(config_path, tmp_path)
    output, _ = process.communicate(timeout=600)
    assert process.returncode == 0, output
    assert "mean reward per step" in output
    assert "uncommitted leftovers of the launch that died" in output
    assert not list((tmp_path / "store" / "run=demo").rglob("_staging-*")) and alive.exists()
    # The killed launches' Dagster runs are marked failed by the launches that followed them, not left started.
    import dagster as dg

    with dg.DagsterInstance.from_config(str(tmp_path / "dagster_home")) as instance:
        runs = instance.get_runs(filters=dg.RunsFilter(job_name="train"))  # newest first
        statuses = [run.status.value for run in runs]
        assert len(runs) >= 2 and statuses == ["SUCCESS"] + ["FAILURE"] * (len(runs) - 1), statuses
        failures = [record.event_log_entry.dagster_event.message
                    for record in instance.get_records_for_run(runs[1].run_id).records
                    if record.event_log_entry.dagster_event and record.event_log_entry.dagster_event.is_run_failure]
        assert failures and "its process died" in failures[-1] and "resumed by Dagster run" in failures[-1]

    assert_every_micro_batch_once(store, steps, micro_batches, checkpoint_every=2)
    # and it ends where a launch never killed ends: the same parameters, AdamW's moments restored on each resume
    assert _sharded_data(demo_config_data, Path("."), steps=4, micro_batches_per_step=2) == {**data, "store": "."}
    for agent in ("solver", "verifier"):
        killed, straight = _weights(store, "demo", agent, steps), _weights(uninterrupted, "demo", agent, steps)
        assert max((straight[n] - killed[n]).abs().max().item() for n in straight) <= PARAMETER_TOLERANCE, agent


def test_synchronous_mode_rejects_staleness(demo_config_data, tmp_path: Path) -> None:
    from marl_pipeline.config import ConfigError

    with pytest.raises(ConfigError, match="mode 'synchronous' trains strictly on-policy"):
        parse_config(small_config_data(demo_config_data, tmp_path, mode="synchronous", staleness=1))


def test_each_agent_keeps_its_own_pace_and_a_kill_9_resumes_every_micro_batch_once(demo_config_data,
                                                                                   tmp_path: Path) -> None:
    """Mixed pace (issue 73.1) with one policy playing two roles and over-sampling, on three agents' roles
    (tests/three_agents.py: the demo's two and a reporter): ``team`` plays the solver and the verifier
    (``agents.team.roles``) held on-policy (``staleness: 0``), the reporter at staleness 2 with engines that load every
    third version (``sync_every: 3``); each group samples 2 episodes more than it keeps (``rollout.oversample``); both
    agents hybrid, as configs/demo.yaml has them.
    Launched from the CLI, its store given by ``--set`` (the file names another: a run config Dagster refused once,
    when `marl train` then hung on Ray), killed with SIGKILL at a random commit and resumed:

    - every micro-batch once, with one version line for the two roles;
    - every team turn sampled at its step's version, the reporter's within 2 and from fewer versions than the
      team's (its engines skipped some); each trains every step at its version;
    - every group trains on its n episodes, never on a dropped one (which ones a group keeps depends on timing, so
      the parameters are not compared; a resumed launch's engines start at the newest committed version, so which
      versions the reporter sampled depends on where the kill fell)."""
    steps, micro_batches = 4, 2
    agents = ("reporter", "team")
    data = small_config_data(demo_config_data, tmp_path / "unused", steps=steps, micro_batches_per_step=micro_batches,
                             staleness=1)
    data["pipeline"]["rollout"] = {"oversample": 2}
    data["environment"] = {"name": "arithmetic_report", "options": data["environment"].get("options", {})}
    data["agents"] = hybrid_agents({"agents": {
        "team": {**data["agents"]["solver"], "roles": ["solver", "verifier"], "staleness": 0},
        "reporter": {**data["agents"]["verifier"], "staleness": 2, "sync_every": 3}}})["agents"]
    config_path = tmp_path / "experiment.yaml"
    config_path.write_text(yaml.safe_dump(data))
    store_setting = f"store={tmp_path / 'store'}"
    store = ExperienceStore(str(tmp_path / "store"))
    total = steps * micro_batches * len(STAGES)
    kill_after_commits(config_path, tmp_path, store, random.Random(os.getpid()).randrange(1, total - len(STAGES)),
                       store_setting, marl=CLI)
    assert _committed(store) < total
    process = _launch(config_path, tmp_path, store_setting, marl=CLI)
    output, _ = process.communicate(timeout=600)
    assert process.returncode == 0, output
    assert not (tmp_path / "unused").exists()
    assert_every_micro_batch_once(store, steps, micro_batches, agents=agents, turns=3)

    rollouts = store.read_stage("demo", "rollouts", columns=["step", "policy_version", "agent", "status"]).to_pylist()
    lag = {agent: {row["step"] - row["policy_version"] for row in rollouts if row["agent"] == agent}
           for agent in agents}
    assert lag["team"] == {0} and lag["reporter"] <= {0, 1, 2}, lag
    sampled = {agent: {row["policy_version"] for row in rollouts if row["agent"] == agent} for agent in agents}
    assert len(sampled["reporter"]) < len(sampled["team"]) == steps, sampled
    health = store.read_stage("demo", "health", columns=["agent", "staleness_max"]).to_pylist()
    assert {row["staleness_max"] for row in health if row["agent"] == "team"} == {0}  # as the health records it
    assert {row["staleness_max"] for row in health if row["agent"] == "reporter"} <= lag["reporter"]
    updates = store.read_stage("demo", "policy_updates", columns=["step", "policy_version", "agent"])
    assert pc.all(pc.equal(updates.column("step"), updates.column("policy_version"))).as_py()
    assert sorted(set(updates.column("agent").to_pylist())) == list(agents)

    rollouts = store.read_stage("demo", "rollouts", columns=["group_id", "episode", "status", "group_dropped"])
    dropped = {(row["group_id"], row["episode"]) for row in rollouts.to_pylist() if row["status"] == "dropped"}
    assert dropped and set(rollouts.column("group_dropped").to_pylist()) == {2}  # each group cut its 2 slowest
    rewards = store.read_stage("demo", "rewards", columns=["group_id", "episode", "status"]).to_pylist()
    episodes: dict[str, set[int]] = {}
    for row in rewards:
        assert row["status"] == "ok" and (row["group_id"], row["episode"]) not in dropped
        episodes.setdefault(row["group_id"], set()).add(row["episode"])
    assert len(episodes) == steps * micro_batches * 4 and {len(kept) for kept in episodes.values()} == {4}
    health = [row for step in range(steps) for row in store.read("health", MicroBatchKey("demo", step, 0)).to_pylist()]
    assert {(row["dropped_episodes"], row["short_groups"]) for row in health} == {(2 * 4 * micro_batches, 0)}
