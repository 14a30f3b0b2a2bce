"""Shared fixtures: the built-in tiny model, a real local Ray, and small experiment configs."""

from __future__ import annotations

import ast
import copy
import functools
import os
import signal
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from marl_pipeline.config import ExperimentConfig, parse_config

ROOT = Path(__file__).resolve().parents[1]

# One token-authentication mode for every Ray cluster of the session, set before anything imports Ray. Ray turns
# token authentication on for a new local cluster when ~/.ray/auth_token exists, while a driver keeps the mode it
# read first: after test_two_nodes.py had set RAY_AUTH_MODE=disabled for its cluster, the next module's
# ray.init started a cluster that wanted a token its driver would not send ("Failed to start GCS ...
# InvalidAuthToken").
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

# OpenMP threads that finish a parallel region sleep at once instead of spinning for the next one, in this process
# and in everything it starts (Ray's workers, `marl` subprocesses). Two pytest workers, each with an engine and a
# trainer of two threads, share the cores: a spinning thread burns the core another process waits for. Beside a
# two-thread torch load on 2 cores, test_lora_sync took 146 s spinning (torch's libgomp default) and 111 s
# passive, the load doing as much work; alone, 79 and 76 s.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# The suite behaves the same started from a terminal or in the background of a script. A background job of a
# non-interactive shell inherits SIGINT ignored; leaving a main-thread execution, Dagster sets SIGTERM to SIGINT's
# handler (dagster._utils.interrupts), so SIGTERM became ignored too, and so in every process started after it:
# Dagster's compute-log `tail` then outlived `terminate()` and each threaded execution waited 2 x 30 s for it
# (test_cli_progress.py: 61 s in a background run, 1.7 s from a terminal), leaving the tails behind.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
if signal.getsignal(signal.SIGTERM) is signal.SIG_IGN:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


LAUNCH_FIXTURES = {"local_ray", "smollm2_dir"}
"""Fixtures that start Ray or convert the real model: a test that needs one is a ``launch`` test (pyproject.toml's
markers), marked or not."""


_RAY_MODULES: set[str] = set()
"""The modules with a test on the shared ``local_ray`` (as a parameter, or asked for by name): they run one after
another, on one Ray while it stays clean (see ``local_ray``)."""
_SHARED_RAY: list = []  # the ray module while the shared local Ray runs


def _stop_shared_ray() -> None:
    if _SHARED_RAY:
        _SHARED_RAY.pop().shutdown()


@functools.cache
def _shares_kept_actors_file(path: str) -> bool:
    """Whether the test module at ``path`` (from the checkout's root) sets ``SHARES_WARM_ACTORS = True`` at its top
    level, read from its source: the one rule for the workers, which import the module, and for pytest-xdist's
    controller, which imports none (``pytest_xdist_make_scheduler``)."""
    tree = ast.parse((ROOT / path).read_text())
    return any(isinstance(node, ast.Assign | ast.AnnAssign) and getattr(node.value, "value", None) is True
               and any(getattr(target, "id", None) == "SHARES_WARM_ACTORS"
                       for target in (node.targets if isinstance(node, ast.Assign) else [node.target]))
               for node in tree.body)


def shares_warm_actors(module) -> bool:
    """Whether a module on the shared Ray sets ``SHARES_WARM_ACTORS = True``: every test in it starts its actors
    through a launch or ``start_engines`` (cluster/spawn.py), which take the engines and trainers kept idle with
    the same settings (cluster/warm_actors.py) and stop the others before waiting for new ones. Such a module takes
    what the one before it kept, and keeps its own for the next: starting them was most of a small launch."""
    return _shares_kept_actors_file(str(Path(module.__file__).relative_to(ROOT)))


def _in_workers(config: pytest.Config) -> bool:
    """Whether this is a pytest-xdist worker (``-n`` of 1 or more): the workers collect, their controller does not."""
    return hasattr(config, "workerinput")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        if LAUNCH_FIXTURES & fixtures:
            item.add_marker(pytest.mark.launch)
        if "local_ray" in fixtures:
            _RAY_MODULES.add(item.module.__name__)
    if not _in_workers(config):
        # A stable sort keeps each module's tests together and in order; the modules on the shared Ray come last,
        # those sharing kept actors last of all, one after another.
        items.sort(key=lambda item: (item.module.__name__ in _RAY_MODULES, shares_warm_actors(item.module)))
        return
    # In workers (``make test``: two on two cores, each with its own suite's Ray) the order is the queue that
    # ``ModulesWhole`` hands out: the modules that share kept actors first (one work unit, to one worker), so that
    # the other worker meanwhile takes the modules that launch without the suite's Ray (the `marl` and `make`
    # processes, the browser, the two nodes), then the rest; the other modules on the suite's Ray come last.
    launching = {item.module.__name__ for item in items if item.get_closest_marker("launch")}

    def queue(item: pytest.Item) -> int:
        name = item.module.__name__
        if name in _RAY_MODULES:
            return 0 if shares_warm_actors(item.module) else 3
        return 1 if name in launching else 2

    items.sort(key=queue)


def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """pytest-xdist's work units: each module whole to one worker (its module fixtures and its launches on one Ray),
    and every module that shares kept actors in one unit, in the order the workers collected them."""
    from xdist.scheduler import LoadScopeScheduling

    class ModulesWhole(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "kept actors" if _shares_kept_actors_file(path) else path

    config.option.loadscopereorder = False  # the collection's order (above), not the largest unit first
    return ModulesWhole(config, log)


def pytest_runtest_setup(item: pytest.Item) -> None:
    """A module that does not use ``local_ray`` runs without it: it may start a Ray of its own, in-process or in
    the CLI, or assert that none is running."""
    if item.module.__name__ not in _RAY_MODULES:
        _stop_shared_ray()


_TORCH_THREADS: list[int] = []  # torch's intra-op threads as the first test found them


@pytest.fixture(autouse=True)
def _torch_threads_kept():
    """Each test leaves the next one torch's thread count as the suite found it. A trainer built in this process
    with ``num_threads`` sets it for the whole process: after tests/test_algorithm_options.py's 1, every later
    in-process computation ran on one of the two cores (the judge's 1,500 steps: 87 s in the suite, 52 s alone)."""
    torch = sys.modules.get("torch")
    if torch is not None and not _TORCH_THREADS:
        _TORCH_THREADS.append(torch.get_num_threads())
    yield
    if _TORCH_THREADS and torch is not None and torch.get_num_threads() != _TORCH_THREADS[0]:
        torch.set_num_threads(_TORCH_THREADS[0])


@pytest.fixture(scope="session")
def demo_config_data() -> dict:
    """The demo config with each agent's engine and trainer in processes of their own: what most tests vary (GPUs,
    workers, swapping, colocation) needs them apart. tests/test_hybrid.py and tests/test_train_job.py run the demo's
    hybrid agents (``hybrid_agents``)."""
    data = yaml.safe_load((ROOT / "configs" / "demo.yaml").read_text())
    for agent in data["agents"].values():
        agent.pop("hybrid", None)
    return data


def hybrid_agents(data: dict, **agent) -> dict:
    """``data`` with every agent hybrid (its trainer in its engine's process), as configs/demo.yaml has them."""
    return {**data, "agents": {name: {**settings, "hybrid": True, **agent}
                               for name, settings in data["agents"].items()}}


def small_config_data(base: dict, store: Path, **pipeline) -> dict:
    """The demo config cut down to seconds: few prompts, few steps, short warm-up."""
    data = copy.deepcopy(base)
    data["store"] = str(store)
    data["pipeline"].update({"steps": 2, "prompts_per_micro_batch": 4, "samples_per_prompt": 4,
                             "micro_batches_per_step": 2, **pipeline})
    for agent in data["agents"].values():
        agent["warmup"] = {"steps": 30}
        # The tiny model's KV cache needs a few MB: reserve 8% of memory (1.9 GiB here, of which the engine process
        # itself holds under 1 GiB), not the default 15% (3.5 GiB), so that vLLM's start-up check ("less than
        # desired CPU memory utilization") passes beside another test's leftovers or a second workload.
        agent.setdefault("engine", {})["gpu_memory_utilization"] = 0.08
    data.pop("evaluation", None)  # the tests that evaluate turn it on themselves
    # A module's launches take the engines and trainers the one before kept (cluster/warm_actors.py): starting
    # them was 25 of a small launch's 28 s. Each test still builds its own store and starting policies.
    data.setdefault("ray", {})["keep_actors"] = True
    return data


@pytest.fixture
def small_config(demo_config_data: dict, tmp_path: Path) -> ExperimentConfig:
    return parse_config(small_config_data(demo_config_data, tmp_path / "store"))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from environments.arithmetic import ArithmeticCheck, ArithmeticOptions
    from marl_pipeline.bootstrap.tiny_model import build_tiny_model

    env = ArithmeticCheck(ArithmeticOptions())
    directory = tmp_path_factory.mktemp("tiny") / "model"
    return build_tiny_model(directory, env.text_corpus(np.random.default_rng(0), 500), seed=0)


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct dequantized from its packaged GGUF into a fresh cache (about 30 s of a core): once a
    suite, for every module that uses the real model (tests/test_model_sources.py checks the conversion). The
    workers of a ``pytest -n`` run share the run's temporary root: the first converts, the others wait for it."""
    import fcntl

    from marl_pipeline.bootstrap.model_sources import resolve_model_source

    base = tmp_path_factory.getbasetemp()
    cache = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "models"
    cache.mkdir(exist_ok=True)
    with (cache.parent / "models.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return Path(resolve_model_source("smollm2-135m-instruct", cache))


def actor_classes() -> dict[str, str]:
    """Every actor the connected Ray cluster has started, alive or dead: its id -> its class's name."""
    import ray

    return {actor_id: info["ActorClassName"] for actor_id, info in ray._private.state.actors().items()}


def _ray_is_idle(ray, wait_s: float = 10.0) -> bool:
    """Every CPU of the cluster free again, as a fresh ``ray.init`` has them (killed actors give theirs back
    within a second or two): no actor, placement group or task of one module is left to the next."""
    import time

    deadline = time.monotonic() + wait_s
    while ray.available_resources().get("CPU") != ray.cluster_resources().get("CPU"):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


@pytest.fixture(scope="module")
def local_ray(request):
    """A real local Ray of 2 CPUs, one per pytest process (each xdist worker has its own). The modules that use it
    run one after another in their process (``pytest_collection_modifyitems``) and share its Ray while each leaves it
    idle: starting and stopping it was 5 s a module. One that leaves an actor or a reservation behind stops it, and
    the next module starts a fresh one. A module that shares kept actors (:func:`shares_warm_actors`) leaves the next
    one its launches' idle engines and trainers, and nothing else: it must have released every actor it started
    (``warm_actors.in_use``), and the next module that does not share them stops them and checks the Ray idle."""
    import ray

    from marl_pipeline.cluster import warm_actors

    _RAY_MODULES.add(request.module.__name__)  # asked for by name in a test, it serves the rest of the module too
    sharing = shares_warm_actors(request.module)
    if _SHARED_RAY and not sharing and warm_actors.stop_idle() and not _ray_is_idle(ray):
        _stop_shared_ray()
    if not _SHARED_RAY:
        if ray.is_initialized():
            ray.shutdown()
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        _SHARED_RAY.append(ray)
    yield ray
    if sharing and ray.is_initialized() and warm_actors.in_use() == 0 and warm_actors.idle_count():
        return  # the kept actors hold the CPUs a check for idleness would count
    warm_actors.stop_idle()
    if not ray.is_initialized():
        _SHARED_RAY.clear()
    elif not _ray_is_idle(ray):
        _stop_shared_ray()


def pytest_sessionfinish(session: pytest.Session) -> None:
    _stop_shared_ray()


@pytest.fixture(scope="session")
def s3_endpoint():
    """A real S3-compatible server (moto's server mode) on 127.0.0.1, with a ``marl`` bucket."""
    import socket

    import boto3
    from moto.server import ThreadedMotoServer

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing", aws_secret_access_key="testing",
                 region_name="us-east-1").create_bucket(Bucket="marl")
    yield endpoint
    server.stop()


@pytest.fixture(params=["local", "s3"])
def store_config(request, tmp_path: Path):
    """The same store tests against a local directory and against S3 (a fresh prefix per test)."""
    from marl_pipeline.config import StoreConfig

    if request.param == "local":
        return StoreConfig(uri=str(tmp_path / "store"))
    endpoint = request.getfixturevalue("s3_endpoint")
    return StoreConfig(uri=f"s3://marl/{tmp_path.name}", endpoint_url=endpoint, region="us-east-1",
                       access_key_id="testing", secret_access_key="testing", policy_cache=str(tmp_path / "cache"))
