"""Benchmark: rollout tokens/s through the engine actor against bare vLLM on the same requests.

One process run, one engine alive at a time (each holds about 3.3 GB): first **ours**, ``RolloutEngine`` in a
Ray actor spawned as ``cluster/spawn.py`` spawns it (``engine_actor``, ``ENGINE_ENV``, the config's threads),
called through ``generate``; it is killed, then **bare** ``vllm.LLM`` is built in this process with the same
model, dtype, memory share, seed, threads and in-process engine core, and called with the same prompts and
per-request ``SamplingParams`` (seed, temperature, max tokens, the sampled token's logprob). Each side gets one
untimed pass over the requests first (batch-shape set-up), then ``--reps`` timed passes; tokens/s is the
generated tokens over the median pass. ``--before`` adds, first, the actor as spawned before this benchmark
(Ray's one thread for a 0.5-CPU actor).

    .venv/bin/python -m bench.engines.engine_throughput --prompts 64 --samples 4 --max-tokens 64 --threads 2 --before
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from marl_pipeline.inference.engine import ENGINE_ENV, GenerationRequest

GPU_MEMORY_UTILIZATION, MAX_MODEL_LEN, SEED = 0.15, 256, 0


def requests(prompts: int, samples: int) -> tuple[list[str], list[int]]:
    """``prompts`` distinct prompts, each ``samples`` times with its own seed."""
    # Short prompts: vLLM 0.32 on CPU fails a seeded request whose prefill is split across steps ("CPU Generator
    # does not use offset"), which happens once a batch's prompt tokens pass max_num_batched_tokens (4096).
    texts = [f"Q{i}: {i % 17} + {(7 * i) % 23} =" for i in range(prompts)]
    return [text for text in texts for _ in range(samples)], list(range(prompts * samples))


def timed(generate, reps: int) -> tuple[list[float], int]:
    """One untimed pass, then ``reps`` timed ones; the seconds of each and the tokens of the last."""
    generate()
    seconds, tokens = [], 0
    for _ in range(reps):
        start = time.perf_counter()
        tokens = generate()
        seconds.append(time.perf_counter() - start)
        print(f"    {seconds[-1]:.2f} s, {tokens} tokens (load {os.getloadavg()[0]:.1f})", flush=True)
    return seconds, tokens


def run_ours(model_dir: str, prompts, seeds, args, threads: int | None) -> tuple[list[float], int]:
    import ray

    from marl_pipeline.cluster.spawn import engine_actor
    from marl_pipeline.config import EngineConfig

    settings = EngineConfig(dtype=args.dtype, threads=threads, max_model_len=MAX_MODEL_LEN,
                            gpu_memory_utilization=GPU_MEMORY_UTILIZATION)
    start = time.perf_counter()
    actor = engine_actor(settings).remote(model_dir, 0, gpu_memory_utilization=settings.gpu_memory_utilization,
                                          max_model_len=settings.max_model_len, dtype=settings.dtype, seed=SEED,
                                          threads=settings.threads)
    ray.get(actor.policy_version.remote())
    print(f"  started in {time.perf_counter() - start:.0f} s", flush=True)

    def generate() -> int:
        _, completions = ray.get(actor.generate.remote([GenerationRequest(prompt, seed, args.max_tokens, 1.0)
                                                        for prompt, seed in zip(prompts, seeds)]))
        return sum(len(c.response_ids) for c in completions)

    try:
        return timed(generate, args.reps)
    finally:
        ray.kill(actor)
        time.sleep(5)  # the actor's process exits and frees its memory before the next engine starts


def run_bare(model_dir: str, prompts, seeds, args) -> tuple[list[float], int]:
    os.environ.update(ENGINE_ENV)  # in-process engine core, no thread binding: as in the actor
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    import torch

    torch.set_num_threads(args.threads)  # before vLLM's CPU worker turns set_num_threads into a no-op
    from vllm import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(model=model_dir, dtype=args.dtype, gpu_memory_utilization=GPU_MEMORY_UTILIZATION,
              max_model_len=MAX_MODEL_LEN, enforce_eager=True, seed=SEED)
    print(f"  started in {time.perf_counter() - start:.0f} s, torch threads {torch.get_num_threads()}", flush=True)
    params = [SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=seed, logprobs=0) for seed in seeds]

    def generate() -> int:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return sum(len(output.outputs[0].token_ids) for output in outputs)

    return timed(generate, args.reps)  # bare runs last: the engine goes with the process


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="a model source (bootstrap/model_sources.py)")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--before", action="store_true", help="also the actor as spawned before (Ray's 1 thread)")
    args = parser.parse_args()

    import ray

    from marl_pipeline.bootstrap.model_sources import resolve_model_source

    model_dir = resolve_model_source(args.model)
    prompts, seeds = requests(args.prompts, args.samples)
    print(f"{model_dir}\n{len(prompts)} requests ({args.prompts} prompts x {args.samples} samples), up to "
          f"{args.max_tokens} tokens, {args.dtype}, {args.threads} threads", flush=True)
    results = {}
    ray.init(num_cpus=args.threads, include_dashboard=False, log_to_driver=False)
    try:
        if args.before:
            print("before (engine actor, Ray's threads):", flush=True)
            results["before"] = run_ours(model_dir, prompts, seeds, args, threads=None)
        print("ours (engine actor):", flush=True)
        results["ours"] = run_ours(model_dir, prompts, seeds, args, threads=args.threads)
    finally:
        ray.shutdown()
    print("bare (vllm.LLM in this process):", flush=True)
    results["bare"] = run_bare(model_dir, prompts, seeds, args)

    rates = {name: tokens / statistics.median(seconds) for name, (seconds, tokens) in results.items()}
    for name, (seconds, tokens) in results.items():
        print(f"{name:>7}: {rates[name]:7.1f} generated tokens/s ({tokens} tokens, median of "
              f"{[round(s, 2) for s in seconds]} s)")
    for name in results:
        if name != "bare":
            print(f"{name} / bare: {rates[name] / rates['bare']:.3f}")


if __name__ == "__main__":
    main()
