"""A sandbox for model-written Python: one short-lived process per run, limited and isolated.

Layers (docs/sandbox.md has the threat model, including what this does not stop):

- a fresh temporary working directory, owned by the sandbox user, removed afterwards;
- an empty environment (no variable of the parent's reaches the code) and ``python -I -S``
  (no PYTHONPATH, no site-packages, the project is not on ``sys.path``);
- rlimits set with :mod:`resource` between fork and exec: CPU seconds, address space, file size,
  processes; a wall-clock timeout kills the whole process group;
- where the parent is root: a new network namespace (``unshare --net``: no interface but a downed
  loopback) and an unprivileged uid without capabilities (``setpriv``), so other users' files,
  ``/proc/<pid>/environ`` of the parent and ``RLIMIT_NPROC`` all apply;
- an audit hook installed before the code runs (PEP 578) that denies opening files outside the
  working directory (the standard library is readable), sockets, fork/exec/subprocess and ctypes.
"""

from __future__ import annotations

import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

SANDBOX_UID = 65534  # nobody
Status = Literal["ok", "error", "denied", "timeout", "cpu_limit", "memory_limit"]
DENIED_MARKER = "sandbox denied:"

# Runs first in the sandboxed interpreter: installs the audit hook, then executes main.py from the cwd.
# Kept free of imports beyond os/sys so nothing outside the standard library is needed.
_BOOTSTRAP = r'''
import os, sys
_ROOT = os.path.realpath(os.getcwd())
_STDLIB = tuple(os.path.realpath(p) for p in sys.path if p) + ("/dev/null", "/dev/urandom")
_WRITE = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_BLOCKED = {"socket.__new__", "socket.connect", "socket.bind", "socket.sendto", "socket.getaddrinfo",
            "os.fork", "os.forkpty", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "subprocess.Popen",
            "ctypes.dlopen", "ctypes.dlsym", "os.kill", "os.killpg", "os.chdir", "os.chroot", "os.symlink",
            "os.link", "os.putenv", "os.unsetenv"}

def _inside(path):
    real = os.path.realpath(os.fsdecode(path))
    return real == _ROOT or real.startswith(_ROOT + os.sep), real

def _hook(event, args):
    if event == "open":
        path, mode, flags = args
        if path is None or isinstance(path, int):
            return
        inside, real = _inside(path)
        writing = any(c in mode for c in "wax+") if isinstance(mode, str) else bool(flags & _WRITE)
        if inside or (not writing and real.startswith(_STDLIB)):
            return
        raise PermissionError(f"sandbox denied: open {real!r} ({'write' if writing else 'read'})")
    if event in ("os.listdir", "os.scandir") and args and args[0] not in (None, ".") and not isinstance(args[0], int):
        inside, real = _inside(args[0])
        if not inside and not real.startswith(_STDLIB):
            raise PermissionError(f"sandbox denied: {event} {args[0]!r}")
    if event in ("os.rename", "os.remove", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.truncate"):
        if args and isinstance(args[0], (str, bytes)) and not _inside(args[0])[0]:
            raise PermissionError(f"sandbox denied: {event} {args[0]!r}")
    if event in _BLOCKED:
        raise PermissionError(f"sandbox denied: {event}")
    if event == "import" and args[0] in ("ctypes", "_ctypes"):
        raise PermissionError("sandbox denied: import " + args[0])

with open("main.py", encoding="utf-8") as _f:
    _code = compile(_f.read(), "main.py", "exec")
sys.addaudithook(_hook)
del _f
exec(_code, {"__name__": "__main__", "__builtins__": __builtins__})
'''


@dataclass(frozen=True)
class SandboxLimits:
    """What one sandboxed run may use."""

    cpu_seconds: int = 5
    """RLIMIT_CPU: the kernel stops the process (SIGXCPU, then SIGKILL) after this much CPU time."""
    memory_bytes: int = 512 * 2**20
    """RLIMIT_AS: address space; an allocation beyond it raises MemoryError."""
    wall_seconds: float = 10.0
    """Wall-clock limit (covers sleeping and blocking, which use no CPU)."""
    max_processes: int = 64
    """RLIMIT_NPROC of the sandbox uid (all its processes, across concurrent sandboxes)."""
    file_bytes: int = 16 * 2**20
    """RLIMIT_FSIZE: largest file the code may write (its captured output included)."""
    output_bytes: int = 64 * 1024
    """Bytes of stdout and of stderr kept in the result."""


@dataclass(frozen=True)
class SandboxResult:
    """The outcome of one sandboxed run."""

    status: Status
    returncode: int | None
    stdout: str
    stderr: str
    wall_seconds: float

    @property
    def reason(self) -> str:
        """One line saying why a run failed (empty when it did not)."""
        if self.status == "ok":
            return ""
        lines = [line for line in self.stderr.strip().splitlines() if line.strip()]
        return f"{self.status}: {lines[-1] if lines else f'exit code {self.returncode}'}"


def isolation_available() -> bool:
    """Whether the namespace and uid layers can be used: root, with ``unshare`` and ``setpriv`` present."""
    return os.geteuid() == 0 and bool(shutil.which("unshare")) and bool(shutil.which("setpriv"))


def isolated_command(command: list[str]) -> list[str]:
    """``command`` in a new network namespace, as the unprivileged sandbox uid without capabilities (the layers
    under the audit hook; needs :func:`isolation_available`)."""
    return ["unshare", "--net", "--", "setpriv", f"--reuid={SANDBOX_UID}", f"--regid={SANDBOX_UID}", "--clear-groups",
            "--inh-caps=-all", "--no-new-privs", "--", *command]


def run_python(code: str, limits: SandboxLimits = SandboxLimits(), files: dict[str, str] | None = None,
               python: str = sys.executable) -> SandboxResult:
    """Run ``code`` as ``main.py`` in a fresh sandbox; never raises for anything the code does.

    Args:
        code: Python source, run as ``__main__``.
        limits: resource limits of the run.
        files: extra files (name -> text) written into the working directory first.
        python: interpreter; started with ``-I -S`` so only its standard library is importable.
    """
    isolated = isolation_available()
    workdir = Path(tempfile.mkdtemp(prefix="marl-sandbox-"))
    try:
        for name, text in {**(files or {}), "main.py": code}.items():
            target = workdir / name
            if target.resolve().parent != workdir.resolve():
                raise ValueError(f"sandbox file name {name!r} must be a plain file name")
            target.write_text(text, encoding="utf-8")
        command = [python, "-I", "-S", "-c", _BOOTSTRAP]
        if isolated:
            for path in [workdir, *workdir.iterdir()]:
                os.chown(path, SANDBOX_UID, SANDBOX_UID)
            command = isolated_command(command)
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            start = time.monotonic()
            process = subprocess.Popen(command, cwd=workdir, env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
                                       stdin=subprocess.DEVNULL, stdout=out, stderr=err, start_new_session=True,
                                       preexec_fn=_limiter(limits), close_fds=True)
            try:
                returncode = process.wait(timeout=limits.wall_seconds)
                timed_out = False
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)  # the session holds every process the code started
                returncode, timed_out = process.wait(), True
            wall = time.monotonic() - start
            stdout, stderr = _head(out, limits.output_bytes), _head(err, limits.output_bytes)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return SandboxResult(_status(returncode, stderr, timed_out), returncode, stdout, stderr, wall)


def _limiter(limits: SandboxLimits):
    """The preexec function: rlimits only (async-signal-safe enough between fork and exec)."""
    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_seconds, limits.cpu_seconds + 1))
        resource.setrlimit(resource.RLIMIT_AS, (limits.memory_bytes, limits.memory_bytes))
        resource.setrlimit(resource.RLIMIT_FSIZE, (limits.file_bytes, limits.file_bytes))
        resource.setrlimit(resource.RLIMIT_NPROC, (limits.max_processes, limits.max_processes))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    return apply


def _head(stream, size: int) -> str:
    stream.seek(0)
    return stream.read(size).decode("utf-8", errors="replace")


def _status(returncode: int, stderr: str, timed_out: bool) -> Status:
    if timed_out:
        return "timeout"
    if returncode in (-signal.SIGXCPU, -signal.SIGKILL, 128 + signal.SIGXCPU, 128 + signal.SIGKILL):
        return "cpu_limit"  # SIGXCPU at the soft limit, SIGKILL at the hard one; a wall timeout is handled above
    if returncode == 0:
        return "ok"
    if DENIED_MARKER in stderr:
        return "denied"
    if "MemoryError" in stderr:
        return "memory_limit"
    return "error"
