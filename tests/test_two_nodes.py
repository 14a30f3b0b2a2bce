"""Multi-node Ray: two raylets on this machine, engines pinned to one and trainers to the other by custom resources,
the store on S3 (moto's server). The train job (the `marl` CLI) joins the cluster by `ray.address`; weights cross
nodes; killing the trainers' node mid-run ends the launch with an error, and a relaunch resumes exactly."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.compute as pc
import pytest
import yaml

from marl_pipeline.config import parse_config
from marl_pipeline.store import ExperienceStore
from marl_pipeline.store.schema import STAGES
from tests.conftest import small_config_data
from tests.test_orchestrator import assert_every_micro_batch_once

pytestmark = pytest.mark.launch

RAY = str(Path(sys.executable).with_name("ray"))
# Ray turns token authentication on for a new cluster when ~/.ray/auth_token exists, and a joining node or driver
# that does not look there then fails to connect: one explicit mode for every process of this test.
# The GCS checks each raylet's health every second, not every 3 (Ray's default), and still declares a node dead only
# after 5 failed checks of up to 10 s each: the launch ended 8 s after the kill, not 18 (the test alone), and a raylet
# slow to answer on a loaded machine still has about as long as with the defaults.
ENV = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", "RAY_health_check_period_ms": "1000"}


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class RayNode:
    """One raylet started with `ray start` in its own session, so its process group is the node: killed with it."""

    ATTEMPTS = 5
    """`ray start` gives a new raylet 30 s to register with the GCS, which a loaded machine can miss: retried."""

    def __init__(self, cwd: Path, *args: str) -> None:
        cwd.mkdir(parents=True, exist_ok=True)
        ports = ["--node-manager-port", "--object-manager-port", "--dashboard-agent-listen-port",
                 "--dashboard-agent-grpc-port", "--runtime-env-agent-port", "--metrics-export-port"]
        for _ in range(self.ATTEMPTS):
            command = [RAY, "start", "--num-cpus", "1", "--object-store-memory", str(200 * 2**20),
                       "--disable-usage-stats", *[part for flag in ports for part in (flag, str(_free_port()))], *args]
            process = subprocess.Popen(command, cwd=cwd, env=ENV, start_new_session=True, stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, text=True)
            self.group = process.pid  # the daemons stay in the group of `ray start`, which exits once they are up
            output, _ = process.communicate(timeout=240)
            if process.returncode == 0:
                return
            self.kill()
        raise RuntimeError(f"ray start failed {self.ATTEMPTS} times; the last:\n{output[-3000:]}")

    def kill(self) -> None:
        try:
            os.killpg(self.group, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.fixture
def cluster(tmp_path: Path):
    """A head node offering `engines` and a worker node offering `trainers`, 1 CPU each; torn down by group."""
    port = _free_port()
    # Ray's unix sockets live under the temp dir, whose path must stay short (107 bytes): not under tmp_path.
    temp_dir = tempfile.mkdtemp(prefix="marl-ray-")
    address, nodes = f"127.0.0.1:{port}", {}

    def start_worker() -> RayNode:
        nodes["worker"] = RayNode(tmp_path / "worker", "--address", address, "--resources", '{"trainers": 4}')
        return nodes["worker"]

    try:
        nodes["head"] = RayNode(tmp_path / "head", "--head", "--port", str(port), "--temp-dir", temp_dir,
                                "--ray-client-server-port", str(_free_port()), "--resources", '{"engines": 4}',
                                "--include-dashboard", "false", "--dashboard-port", str(_free_port()))
        start_worker()
        yield address, start_worker, nodes
    finally:
        for node in nodes.values():
            node.kill()
        shutil.rmtree(temp_dir, ignore_errors=True)


def _launch(config_path: Path, cwd: Path) -> subprocess.Popen:
    env = {**ENV, "DAGSTER_HOME": str(cwd / "dagster_home")}
    return subprocess.Popen([sys.executable, "-m", "assets.cli", "train", str(config_path)], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _committed(store: ExperienceStore) -> int:
    return sum(len(store.committed_keys("demo", stage)) for stage in STAGES)


def _placement() -> dict[str, list[set[str]]]:
    """From Ray's actor table (the GCS's; the state API would need the full dashboard, not installed here): the
    custom resources of the node each live engine and trainer runs on."""
    import ray

    resources = {node["NodeID"]: {r for r in node["Resources"] if r in ("engines", "trainers")} for node in ray.nodes()}
    placed: dict[str, list[set[str]]] = {"Engine": [], "Trainer": []}
    for actor in ray._private.state.actors(actor_state_name="ALIVE").values():
        kind = next((k for k in placed if actor["ActorClassName"].endswith(k)), None)  # StoreAsyncEngine, StoreTrainer
        if kind is not None:
            placed[kind].append(resources[actor["Address"]["NodeID"]])
    return placed


def test_two_nodes_pin_sync_and_survive_the_loss_of_the_trainers_node(cluster, demo_config_data, s3_endpoint,
                                                                     tmp_path: Path, monkeypatch) -> None:
    import ray

    address, start_worker, nodes = cluster
    # The node dies once version 1 is out, with steps to go: with commits written behind the stages an S3 step takes
    # 0.7 s, and a 5-step run once ended between two of this test's polls (3 steps did, before writes went behind)
    steps, micro_batches = 8, 2
    data = small_config_data(demo_config_data, tmp_path, steps=steps, micro_batches_per_step=micro_batches)
    data["store"] = {"uri": f"s3://marl/{tmp_path.name}", "endpoint_url": s3_endpoint, "region": "us-east-1",
                     "access_key_id": "testing", "secret_access_key": "testing"}  # each node caches in its own cwd
    data["ray"] = {"address": address, "engine_resources": {"engines": 1}, "trainer_resources": {"trainers": 1}}
    config_path = tmp_path / "experiment.yaml"
    config_path.write_text(yaml.safe_dump(data))
    store = ExperienceStore(parse_config(data).store.model_copy(update={"policy_cache": str(tmp_path / "test-cache")}))
    driver = tmp_path / "driver"
    driver.mkdir()

    process = _launch(config_path, driver)
    deadline = time.monotonic() + 420
    placed = {}
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    ray.init(address=address, log_to_driver=False)  # this test joins too, to read the actor table
    try:
        # Kill the trainers' node once version 1 (or a later one) is committed and the next step is under way: after a
        # weight sync, mid-step.
        while process.poll() is None and time.monotonic() < deadline:
            if any(len(placed.get(c, [])) < 2 for c in ("Engine", "Trainer")):  # until all four are up
                placed = _placement()
            if store.policy_versions("demo", "verifier")[-1:] >= [1] and _committed(store) >= 4 * micro_batches + 2:
                break
            time.sleep(0.5)
    finally:
        ray.shutdown()
    assert process.poll() is None, process.communicate()[0][-4000:]
    assert placed == {"Engine": [{"engines"}] * 2, "Trainer": [{"trainers"}] * 2}, placed
    before = _committed(store)
    nodes["worker"].kill()
    killed_at = time.monotonic()
    output, _ = process.communicate(timeout=300)  # not a hang: the launch ends on its own
    first_output = output
    print(f"launch ended {time.monotonic() - killed_at:.0f} s after the node was killed")
    assert process.returncode != 0, output[-4000:]
    # Ray's own error for the dead node, with the orchestrator stage it came from: a call on one of its actors
    # (unavailable while Ray still checks the node, dead after), or an object only it held (a trainer's new weights),
    # whichever call fails first
    assert re.search(r"ray\.exceptions\.(Actor(Unavailable|Died)Error|ObjectReconstructionFailedError"
                     r"|ObjectLostError)", output), output[-4000:]
    assert "stage of the marl_pipeline orchestrator" in output, output[-4000:]
    assert before < steps * micro_batches * len(STAGES)

    start_worker()
    process = _launch(config_path, driver)
    output, _ = process.communicate(timeout=600)
    assert process.returncode == 0, output[-4000:]

    assert_every_micro_batch_once(store, steps, micro_batches)  # nothing lost, nothing twice, in the bucket
    rollouts = store.read_stage("demo", "rollouts", columns=["step", "micro_batch", "agent", "policy_version"])
    served = sorted(set(zip(*(rollouts.column(c).to_pylist() for c in ("step", "micro_batch", "agent",
                                                                       "policy_version")))))
    # staleness 0, also for what the first launch sampled while it stopped (it sampled on with the old policy once)
    assert all(step == version for step, _, _, version in served), (served, first_output[-3000:], output[-3000:])
    # The engines (head node) served each version the trainers (worker node) stepped to: the engine's logprobs of
    # every trained sample equal the trainer's, at versions 1 and 2 as at 0.
    updates = store.read_stage("demo", "policy_updates", columns=["step", "agent", "mismatch_abs_logprob"])
    assert set(updates.column("step").to_pylist()) == set(range(steps))
    assert pc.max(updates.column("mismatch_abs_logprob")).as_py() < 1e-4
    # the committed copies are in the bucket: no node's cache is needed to read them
    assert not (tmp_path / "test-cache").exists()
    assert (store.require_policy("demo", "solver", steps) / "model.safetensors").stat().st_size > 0
