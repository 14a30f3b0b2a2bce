"""A training launch whose plugin calls a tool service and whose reward asks an LLM judge, both outside the
cluster and under quotas: the calculator is a real HTTP server on 127.0.0.1 (tests/quota_proxy.py), the judge is
vLLM's own OpenAI-compatible server with SmolLM2 behind the same quota-enforcing proxy."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from marl_pipeline.config import parse_config
from tests.conftest import small_config_data
from tests.quota_proxy import QuotaProxy

pytestmark = pytest.mark.launch
SHARES_WARM_ACTORS = True  # its launches take the engines and trainers the module before kept (conftest)


@pytest.fixture(scope="module")
def judge_server(smollm2_dir: Path, tmp_path_factory):
    """vLLM's OpenAI-compatible server on 127.0.0.1 serving SmolLM2 as ``judge``, eager as the run's own engines."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    log = (tmp_path_factory.mktemp("judge") / "server.log").open("w")
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    server = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
                               str(smollm2_dir), "--served-model-name", "judge", "--host", "127.0.0.1", "--port",
                               str(port), "--max-model-len", "1024", "--gpu-memory-utilization", "0.08",
                               "--enforce-eager"],  # no compiling warm-up: 51 of its 80 s to start here
                              stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}/v1"
    deadline = time.monotonic() + 400
    try:
        while True:
            assert server.poll() is None, f"the judge server exited ({log.name})"
            try:
                if httpx.get(url + "/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"the judge server did not start in 400 s ({log.name})"
            time.sleep(2)
        yield url
    finally:
        server.terminate()
        server.wait(60)
        log.close()


def test_a_launch_calls_its_tool_and_judge_under_their_quotas(local_ray, demo_config_data: dict, tmp_path: Path,
                                                              judge_server: str) -> None:
    from marl_pipeline.run.recipe import train
    from marl_pipeline.services.judge import JudgeScorer
    from marl_pipeline.store import ExperienceStore

    calculator = QuotaProxy(requests_per_second=20, latency_s=0.02,
                            answer=lambda path, body: {"sum": body["a"] + body["b"]})
    judge = QuotaProxy(requests_per_second=8, upstream=judge_server.removesuffix("/v1"))
    try:
        data = small_config_data(demo_config_data, tmp_path / "store", steps=2, micro_batches_per_step=1)
        data["environment"] = {"name": "arithmetic_tool", "options": data["environment"].get("options", {})}
        data["services"] = {"calculator": {"base_url": calculator.url, "requests_per_second": 20},
                            "judge": {"base_url": judge.url + "/v1", "requests_per_second": 8, "concurrency": 4}}
        data["reward"] = {"judge": {"service": "judge", "model": "judge", "agents": ["verifier"], "weight": 0.5}}
        config = parse_config(data)
        list(train(config))
    finally:
        calculator.close()
        judge.close()
    store = ExperienceStore(config.store)
    rollouts = store.read_stage(config.run, "rollouts").to_pylist()
    episodes = 2 * 4 * 4  # steps x prompts x samples
    # Every call was let through at the quota: none refused, each episode asked the calculator once.
    assert calculator.refused == 0 and len(calculator.served) == episodes
    for row in rollouts:
        if row["role"] == "verifier":
            task = json.loads(row["task"])
            assert row["prompt_text"].endswith(f"{task['a'] + task['b']}:")  # the tool's reply, shown
    # The judge scored every verifier turn through its service, within 8 calls a second: none refused.
    assert judge.refused == 0 and len(judge.served) == episodes
    rewards = store.read_stage(config.run, "rewards").to_pylist()
    scored = [row for row in rewards if row["agent"] == "verifier"]
    assert all(row["model_score"] is not None and 0 <= row["model_score"] <= 1 for row in scored)
    assert all(row["model_score"] is None for row in rewards if row["agent"] == "solver")
    prompts = {row["sample_id"]: row for row in rollouts}
    first = scored[0]
    scorer = JudgeScorer(config.reward.judge)
    from marl_pipeline.external import Permit, ServiceClient

    class Unlimited:  # the proxy is closed: the check asks the server itself, unscheduled
        def acquire(self, cost, tokens):
            return Permit(0, 0.0)

        async def acquire_async(self, cost, tokens):
            return Permit(0, 0.0)

        def release(self, *args):
            pass

    scorer._client = ServiceClient("judge", config.services["judge"].model_copy(update={"base_url": judge_server}),
                                   Unlimited())
    again = scorer.score([prompts[first["sample_id"]]["prompt_text"]], [prompts[first["sample_id"]]["response_text"]])
    assert again[0] == pytest.approx(first["model_score"], abs=0.02)
    # Each step's figures are stored with the step and shown by `marl inspect`.
    figures = store.read_stage(config.run, "services").to_pylist()
    assert sorted((row["step"], row["service"]) for row in figures) == [
        (0, "calculator"), (0, "judge"), (1, "calculator"), (1, "judge")]
    assert sum(row["calls"] for row in figures if row["service"] == "calculator") == episodes
    assert all(row["throttled"] == 0 and row["failures"] == 0 for row in figures)
    # In a process of its own: Rich reads the terminal's width once per console, and an earlier test's may hold
    shown = subprocess.run([sys.executable, "-m", "assets.cli", "inspect", str(tmp_path / "store"), "--run",
                            config.run], capture_output=True, text=True, timeout=120,
                           cwd=Path(__file__).resolve().parents[1], env={**os.environ, "COLUMNS": "120"})
    assert shown.returncode == 0, shown.stdout + shown.stderr
    assert "external services" in shown.stdout and "calculator" in shown.stdout
