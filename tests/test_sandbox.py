"""The sandbox stops or denies hostile code with a clear status, and a pool worker keeps serving after it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from marl_pipeline.actions.pool import ActionPool
from marl_pipeline.actions.worker import Job
from marl_pipeline.config import PoolSettings
from marl_pipeline.sandbox import SandboxLimits, isolated_command, isolation_available, run_python

LIMITS = SandboxLimits(cpu_seconds=1, wall_seconds=3, memory_bytes=256 * 2**20)

HOSTILE = {
    "loops forever": ("while True:\n    pass", "cpu_limit"),
    "sleeps forever": ("import time\ntime.sleep(1000)", "timeout"),
    "allocates 10 GB": ("x = bytearray(10 * 1024**3)", "memory_limit"),
    "fork-bombs": ("import os\nwhile True:\n    os.fork()", "denied"),
    "opens a network socket": ("import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=1)", "denied"),
    "reads the parent's environ": ("import os\nprint(open(f'/proc/{os.getppid()}/environ').read())", "denied"),
    "reads a project file": (f"print(open({os.path.abspath('pyproject.toml')!r}).read())", "denied"),
    "writes outside its directory": ("open('/tmp/marl-escape.txt', 'w').write('x')", "denied"),
    "starts a subprocess": ("import subprocess\nsubprocess.run(['id'])", "denied"),
}


@pytest.mark.launch
@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_code_is_stopped_or_denied(case: str) -> None:
    code, status = HOSTILE[case]
    result = run_python(code, LIMITS)
    assert result.status == status, (result.status, result.stderr[-300:])
    assert result.reason.startswith(status)
    assert not os.path.exists("/tmp/marl-escape.txt")


def test_parent_environment_does_not_reach_the_code(monkeypatch) -> None:
    monkeypatch.setenv("MARL_TEST_SECRET", "hunter2")
    result = run_python("import os\nprint(sorted(os.environ))", LIMITS)
    assert result.status == "ok"
    assert "MARL_TEST_SECRET" not in result.stdout and "hunter2" not in result.stdout


def test_working_directory_is_usable_then_removed() -> None:
    code = ("import os, json\nopen('a.txt', 'w').write('hi')\nprint(os.getcwd())\n"
            "print(json.dumps(open('a.txt').read()))")
    result = run_python(code, LIMITS)
    assert result.status == "ok", result.stderr
    workdir, text = result.stdout.splitlines()
    assert text == '"hi"' and not os.path.exists(workdir)


def _interfaces(command: list[str]) -> set[str]:
    table = subprocess.run(command, capture_output=True, text=True, check=True, timeout=30).stdout
    return {line.split(":")[0].strip() for line in table.splitlines()[2:] if line.strip()}


@pytest.mark.skipif(not isolation_available(), reason="the namespace and uid layers need root, unshare and setpriv")
def test_no_network_even_past_the_audit_hook() -> None:
    # The namespace layer on its own, without the hook (which would deny reading /proc first): the sandbox's command
    # sees a loopback only where this process sees more. Without `unshare --net` it would see eth0 and fail.
    read = [sys.executable, "-I", "-S", "-c", "print(open('/proc/net/dev').read())"]
    outside = _interfaces(read)
    if outside == {"lo"}:
        pytest.skip("this machine has no interface but loopback: nothing to hide")
    assert _interfaces(isolated_command(read)) == {"lo"}
    # and through the sandbox itself, the hook answers first
    result = run_python("print(open('/proc/net/dev').read())", LIMITS)
    assert result.status == "denied" and "net/dev" in result.reason


@pytest.mark.launch
def test_pool_worker_keeps_serving_after_hostile_code(local_ray) -> None:
    pool = ActionPool(PoolSettings(min_workers=1, max_workers=1, timeout_s=30, num_cpus=0))
    codes = [code for code, _ in HOSTILE.values()] + ["print(6 * 7)"]
    outcomes = pool.map([Job(run_python, (code, LIMITS)) for code in codes])
    assert all(o.status == "ok" for o in outcomes)  # the action itself returns the sandbox's verdict
    assert [o.value.status for o in outcomes] == [s for _, s in HOSTILE.values()] + ["ok"]
    assert outcomes[-1].value.stdout == "42\n"
    assert pool.peak_workers == 1  # the same worker served them all
    pool.shutdown()
