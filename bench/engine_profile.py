"""An engine profile for the planner (marl_pipeline/planner/engine_profile.py): bare vLLM's decode step by batch
and context length, and its prefill by tokens, on this machine's device, written as JSON for
``marl plan --gpu KIND --engine-profile AGENT=FILE``.

    .venv/bin/python bench/engine_profile.py --model DIR --out engine.json [--tensor-parallel 1]

Decode: a batch of ``batch`` prompts of ``context`` tokens each generates ``--decode-tokens`` tokens (ignoring
end-of-sequence); its step is (the generation's seconds - the same batch's one-token generation) over the tokens
after the first, so prefill is taken out. Prefill: a one-token generation of prompts adding up to ``tokens``.
Each point's median over ``--reps`` runs after an untimed one; token ids below 210, which every vocabulary has.
Plain ``vllm.LLM``, eager as the project's engines run: what the planner's simulation charges an engine step for.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from marl_pipeline.inference.engine import ENGINE_ENV

BATCHES, CONTEXTS, PREFILL_TOKENS = (1, 8, 32, 64), (64, 128, 512, 1024), (1024, 4096, 8192)


def _seconds(llm, prompts: list[list[int]], tokens: int, reps: int) -> float:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=1.0)
    batch = [{"prompt_token_ids": ids} for ids in prompts]
    llm.generate(batch, params, use_tqdm=False)
    runs = []
    for _ in range(reps):
        start = time.perf_counter()
        llm.generate(batch, params, use_tqdm=False)
        runs.append(time.perf_counter() - start)
    return statistics.median(runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="A model directory vLLM loads.")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tensor-parallel", type=int, default=1)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    args = parser.parse_args()
    os.environ.update(ENGINE_ENV)
    from vllm import LLM

    # eager, as the project's engines run (inference/engine.py)
    llm = LLM(args.model, tensor_parallel_size=args.tensor_parallel, max_model_len=args.max_model_len,
              gpu_memory_utilization=args.gpu_memory_utilization, seed=0, enforce_eager=True)
    device = _device()
    decode = []
    for context in (c for c in CONTEXTS if c + args.decode_tokens <= args.max_model_len):
        for batch in BATCHES:
            prompts = [[(7 * i + k) % 200 + 10 for k in range(context)] for i in range(batch)]
            whole, first = (_seconds(llm, prompts, tokens, args.reps) for tokens in (args.decode_tokens, 1))
            step = (whole - first) / (args.decode_tokens - 1)
            decode.append({"batch": batch, "context": context, "step_seconds": step})
            print(f"decode batch {batch} context {context}: {step * 1e3:.2f} ms a step", flush=True)
    prefill = []
    for tokens in PREFILL_TOKENS:
        length = min(args.max_model_len - 1, 512)
        prompts = [[(3 * i + k) % 200 + 10 for k in range(length)] for i in range(max(1, tokens // length))]
        seconds = _seconds(llm, prompts, 1, args.reps)
        prefill.append({"tokens": length * len(prompts), "seconds": seconds})
        print(f"prefill {length * len(prompts)} tokens: {seconds * 1e3:.1f} ms", flush=True)
    args.out.write_text(json.dumps({"gpu": device, "model": args.model, "tensor_parallel": args.tensor_parallel,
                                    "decode": decode, "prefill": prefill}, indent=1))


def _device() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"CPU ({os.cpu_count()} cores)"


if __name__ == "__main__":
    main()
