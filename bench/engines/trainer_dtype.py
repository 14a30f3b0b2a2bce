"""Benchmark: one trainer forward/backward step in float32, bf16 autocast (float32 weights) and pure bf16.

The three run side by side in one process, interleaved rep by rep, so that other jobs on the machine hit
them alike; the figures to compare are the ratios to float32. The model is the SmolLM2-135M shape (Llama,
hidden 576, 30 layers, 9 heads, 3 kv heads, vocab 49152, tied embeddings) with random weights, or a
Hugging Face directory (``--model``, for logprob differences of a trained model). The step is what
``PolicyTrainer.accumulate`` does: token logprobs from a float32 log-softmax, a summed loss, backward.

    .venv/bin/python -m bench.engines.trainer_dtype --threads 2 --rows 16 --tokens 96 --reps 3
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from marl_pipeline.policy.precision import autocast, cpu_has_bf16
from marl_pipeline.training.losses import token_logprobs

SMOLLM2_135M = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True, max_position_embeddings=2048)


def _model(path: str | None):
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    if path:
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**SMOLLM2_135M))


def _inputs(path: str | None, rows: int, tokens: int, vocab: int) -> torch.Tensor:
    if not path:
        return torch.randint(0, vocab, (rows, tokens), generator=torch.Generator().manual_seed(0))
    from transformers import AutoTokenizer

    text = ("The trainer computes the log-probability of every response token under the current policy, "
            "weights it by the group-relative advantage and clips the ratio to the rollout engine's. ") * 40
    ids = AutoTokenizer.from_pretrained(path)(text)["input_ids"]
    return torch.tensor([ids[7 * r: 7 * r + tokens] for r in range(rows)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a Hugging Face directory (default: random SmolLM2 shape)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    fp32 = _model(args.model)
    params = sum(p.numel() for p in fp32.parameters())
    pure = copy.deepcopy(fp32).to(torch.bfloat16)
    input_ids = _inputs(args.model, args.rows, args.tokens, fp32.config.vocab_size)
    attention = torch.ones_like(input_ids)
    response = torch.zeros(args.rows, args.tokens - 1)
    response[:, args.tokens // 2:] = 1.0  # the second half of every row is "response"
    modes = {"float32": (fp32, torch.float32), "autocast-bf16": (fp32, torch.bfloat16),
             "pure-bf16": (pure, torch.float32)}
    print(f"{params / 1e6:.1f}M params, {args.rows}x{args.tokens} tokens, {args.threads} threads, "
          f"cpu bf16 (amx/avx512_bf16): {cpu_has_bf16()}, torch cpu capability "
          f"{torch.backends.cpu.get_cpu_capability()}")

    with torch.no_grad():
        logprobs = {}
        for name, (model, dtype) in modes.items():
            with autocast(dtype, "cpu"):
                logprobs[name] = token_logprobs(model, input_ids, attention)[response.bool()]
    for name in ("autocast-bf16", "pure-bf16"):
        diff = (logprobs[name] - logprobs["float32"]).abs()
        print(f"|logprob {name} - float32|: mean {diff.mean():.4f}, max {diff.max():.4f} "
              f"(float32 mean logprob {logprobs['float32'].mean():.3f})")

    if not args.reps:
        return
    # Wall time, and this process's CPU time (both threads): on a shared machine the CPU time is the robust one.
    wall: dict[str, list[float]] = {name: [] for name in modes}
    cpu: dict[str, list[float]] = {name: [] for name in modes}
    for rep in range(args.reps + 1):  # rep 0 warms up, on two rows
        rows = slice(None) if rep else slice(0, 2)
        for name, (model, dtype) in modes.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            with autocast(dtype, "cpu"):
                loss = -(token_logprobs(model, input_ids[rows], attention[rows]) * response[rows]).sum()
            loss.backward()
            model.zero_grad(set_to_none=True)
            if rep:
                wall[name].append(time.perf_counter() - start)
                cpu[name].append(time.process_time() - start_cpu)
                print(f"  rep {rep} {name}: {wall[name][-1]:.1f} s wall, {cpu[name][-1]:.1f} s cpu", flush=True)
    tokens = args.rows * args.tokens
    base_wall, base_cpu = statistics.median(wall["float32"]), statistics.median(cpu["float32"])
    for name in modes:
        median_wall, median_cpu = statistics.median(wall[name]), statistics.median(cpu[name])
        print(f"{name:>14}: {tokens / median_wall:6.1f} tokens/s wall ({base_wall / median_wall:.2f}x float32), "
              f"{tokens / median_cpu:6.1f} tokens per CPU-second ({base_cpu / median_cpu:.2f}x float32); "
              f"wall {[round(t, 1) for t in wall[name]]} s, cpu {[round(t, 1) for t in cpu[name]]} s")


if __name__ == "__main__":
    main()
