#!/usr/bin/env bash
# Issue 49's checks on a GPU in one run of under ten minutes (an H200: torch, transformers, peft and Triton, no Ray,
# vLLM or Dagster): the GPU suite's packing and budget tests, the RL-shaped benchmark for Llama-3.2-1B's and
# Qwen2.5-3B's shapes against the packed bound (bench/engines/gpu_trainer.py --rl), then the rest of the GPU suite in the
# time left. Each part has its own limit, so a failing one leaves the others' figures.
#   bash bench/engines/gpu_check.sh OUT_DIR [SECONDS]
set -u
out=${1:-.}
deadline=${2:-570}  # seconds; LLAMA_VARIANTS="bound default unfused padded2048" adds the old default
export PYTHONUNBUFFERED=1
left() { echo $((deadline - SECONDS)); }
quiet() { grep --line-buffered -v -e "Loading weights" -e "Writing model shards"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" \
  | tee -a "$out/gpu.txt"
suite=(python3 -m pytest tests/gpu --confcutdir=tests/gpu -p no:cacheprovider -s -q -rA)
timeout 130 "${suite[@]}" -k "packed or unset_budget" 2>&1 | quiet | tee "$out/suite_new.log"
timeout 200 python3 -m bench.engines.gpu_trainer --rl --models llama-1b --checkpointing 1 0 --repeats 3 \
  --variants ${LLAMA_VARIANTS:-bound default unfused} --out "$out/rl_llama.json" 2>&1 | quiet | tee "$out/rl_llama.log"
timeout "$(left)" python3 -m bench.engines.gpu_trainer --rl --models qwen2.5-3b --checkpointing 1 0 --variants bound default \
  --repeats 2 --out "$out/rl_qwen.json" 2>&1 | quiet | tee "$out/rl_qwen.log"
[ "$(left)" -gt 60 ] && timeout "$(left)" "${suite[@]}" -k "not (packed or unset_budget)" 2>&1 | quiet \
  | tee "$out/suite_rest.log"
echo "done at ${SECONDS}s"
