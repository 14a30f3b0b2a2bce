"""Benchmark: the asynchronous engine actor against the bare engine, trajectory-level against turn-batched rollout,
and sticky against round-robin routing over two replicas.

One process run, at most two vLLM engines alive at a time (the machine runs other jobs), side by side:

1. **Overhead.** The same requests (``--prompts`` x ``--samples``, seeded, ``--max-tokens`` each, EOS ignored so
   both sides generate the same token count) through one ``AsyncRolloutEngine`` actor, each request its own
   ``generate_one`` call, all in flight at once, and through the bare in-process engine it wraps (vLLM's
   ``LLMEngine`` in this process: every request added, then ``step()`` until all finished), both alive, timed in
   alternating passes: the baseline of the 0.95 bar. Then, for information, after both are gone, through bare
   ``vllm.v1.engine.async_llm.AsyncLLM`` in this process (its engine core runs in its own processes, as vLLM
   builds it), each request its own ``generate`` stream, all in flight at once. Same model, dtype, memory share,
   seed, threads, batch limits. One untimed pass each, then ``--reps`` timed ones; tokens/s over the median pass.
2. **Long tail.** A three-turn workflow (writer, checker, writer) whose response lengths are lognormal
   (median ``--length-median``, sigma ``--length-sigma``; each request's length is a function of its seed, so
   both modes generate exactly the same tokens) and whose environment reply after every turn sleeps a lognormal
   time (median ``--reply-ms``, sigma ``--reply-sigma``, a function of the task and the turn). The same
   micro-batches through today's turn-batched rollout (``stages/rollout.py``) and trajectory-level rollout
   (``stages/trajectories.py``), alternating, on the same engine actor (one engine serves both roles), once
   with the replies' latency and once without (lengths alone). Episodes/s over all micro-batches.
3. **Routing.** Two engine replicas (``--threads`` split between them), ``--route-episodes`` episodes of
   ``--route-turns`` turns as token ids: a random ``--route-context``-token context, then each turn's prompt is the
   previous prompt, its response (``--route-tokens``, EOS ignored) and an 8-token reply. Each turn goes to the
   replica the agent's router (inference/router.py) picks, sticky or round-robin, alternating passes, each pass with
   fresh contexts (no hits from earlier passes). Prefix-cache hit rate from vLLM's own per-request count of cached
   prompt tokens (``num_cached_tokens``, summed by the engine actor's ``prefix_cache_stats``), and tokens/s.
   Each replica's KV cache holds ``--route-cache`` times sticky routing's peak working set: its half of the
   episodes, all in flight at their longest (last turn's prompt and response, in whole blocks). A pool sized to
   its load runs with such a cache; round-robin needs every episode's prefix on both replicas, twice the room,
   or with ``--route-cache 0`` what the memory share gives, far more than the workload ever uses.

    nice -n 15 .venv/bin/python -m bench.pipeline.rollout
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import ClassVar

import numpy as np

from bench.engines.engine_throughput import timed
from marl_pipeline.inference.async_engine import AsyncRolloutEngine
from marl_pipeline.inference.engine import ENGINE_ENV, MAX_NUM_SEQS, GenerationRequest

GPU_MEMORY_UTILIZATION, SEED = 0.04, 0  # about 1 GiB each; the tiny model's KV cache needs far less
ROUTING_MEMORY = 0.04
"""Each routing replica's memory share (two engines at once, on a shared machine; the tiny model needs little)."""
CPU_BLOCK_TOKENS = 128  # vLLM's CPU backend caches prefixes in blocks of 128 tokens


def load() -> str:
    return f"load {os.getloadavg()[0]:.1f}"


def model_directory(source: str) -> str:
    if source != "tiny":
        from marl_pipeline.bootstrap.model_sources import resolve_model_source

        return str(resolve_model_source(source))
    from environments.arithmetic import ArithmeticCheck, ArithmeticOptions
    from marl_pipeline.bootstrap.tiny_model import build_tiny_model

    env = ArithmeticCheck(ArithmeticOptions())
    return str(build_tiny_model(Path(tempfile.mkdtemp()) / "tiny", env.text_corpus(np.random.default_rng(0), 500),
                                seed=0))


# -- 1. overhead ------------------------------------------------------------------------------------
def overhead_requests(args) -> list[tuple[str, int]]:
    texts = [f"Q{i}: {i % 17} + {(7 * i) % 23} =" for i in range(args.prompts)]
    return [(text, p * args.samples + s) for p, text in enumerate(texts) for s in range(args.samples)]


def overhead_side_by_side(ray, model_dir: str, args) -> dict[str, tuple[list[float], int]]:
    """Our engine actor and the bare in-process engine (what the actor wraps, stepped the same way, without Ray or
    the engine thread), alive together and timed in alternating passes."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    from marl_pipeline.cluster.spawn import engine_actor
    from marl_pipeline.config import EngineConfig
    from marl_pipeline.inference.engine import RolloutEngine

    requests = overhead_requests(args)
    actor = engine_actor(EngineConfig(threads=args.threads), actor_class=AsyncRolloutEngine).remote(
        model_dir, 0, gpu_memory_utilization=GPU_MEMORY_UTILIZATION, max_model_len=args.max_model_len,
        dtype=args.dtype, seed=SEED, threads=args.threads)
    ray.get(actor.policy_version.remote())
    os.environ.update(ENGINE_ENV)  # VLLM_ENABLE_V1_MULTIPROCESSING=0: the engine core in this process
    engine = RolloutEngine(model_dir, 0, gpu_memory_utilization=GPU_MEMORY_UTILIZATION,
                           max_model_len=args.max_model_len, dtype=args.dtype, seed=SEED, threads=args.threads)
    core, passes = engine.llm.llm_engine, iter(range(1_000_000))

    def ours() -> int:
        n = next(passes)
        refs = [actor.generate_one.remote(f"{n}-{i}", GenerationRequest(prompt, seed, args.max_tokens, 1.0,
                                                                          ignore_eos=True))
                for i, (prompt, seed) in enumerate(requests)]
        return sum(len(s.completion.response_ids) for s in ray.get(refs))

    def in_process() -> int:  # the engine actor's loop, bare: add every request, step until all have finished
        n = next(passes)
        for i, (prompt, seed) in enumerate(requests):
            core.add_request(f"{n}-{i}", prompt, SamplingParams(
                max_tokens=args.max_tokens, temperature=1.0, seed=seed, logprobs=0, ignore_eos=True,
                output_kind=RequestOutputKind.FINAL_ONLY))
        tokens, left = 0, len(requests)
        while left:
            for output in core.step():
                if output.finished:
                    tokens, left = tokens + len(output.outputs[0].token_ids), left - 1
        return tokens

    runs = {"ours": ours, "in-process": in_process}
    results: dict[str, tuple[list[float], int]] = {name: ([], 0) for name in runs}
    try:
        for run in runs.values():  # untimed: one-off set-up of batch shapes
            run()
        for _ in range(args.reps):
            for name, run in runs.items():
                start = time.perf_counter()
                tokens = run()
                results[name][0].append(time.perf_counter() - start)
                results[name] = (results[name][0], tokens)
                print(f"    {name}: {results[name][0][-1]:.2f} s, {tokens} tokens ({load()})", flush=True)
        return results
    finally:
        ray.kill(actor)
        time.sleep(5)  # the actor's process exits and frees its memory before the next engine starts


def overhead_bare(model_dir: str, args) -> tuple[list[float], int]:
    # vLLM's own processes inherit these: no thread binding and the same thread count as our actor.
    os.environ.update({k: v for k, v in ENGINE_ENV.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"})
    os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # set by the in-process baseline; AsyncLLM ignores it
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    requests = overhead_requests(args)
    loop = asyncio.new_event_loop()
    engine_args = AsyncEngineArgs(model=model_dir, dtype=args.dtype, gpu_memory_utilization=GPU_MEMORY_UTILIZATION,
                                  max_model_len=args.max_model_len, enforce_eager=True, seed=SEED,
                                  max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=MAX_NUM_SEQS * args.max_model_len)
    llm = loop.run_until_complete(_async_llm(AsyncLLM, engine_args))
    passes = iter(range(1_000_000))

    async def one(request_id: str, prompt: str, seed: int) -> int:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=seed, logprobs=0, ignore_eos=True,
                                output_kind=RequestOutputKind.FINAL_ONLY)
        async for output in llm.generate(prompt, params, request_id):
            last = output
        return len(last.outputs[0].token_ids)

    async def run_all(n: int) -> int:
        return sum(await asyncio.gather(*[one(f"{n}-{i}", p, s) for i, (p, s) in enumerate(requests)]))

    try:
        return timed(lambda: loop.run_until_complete(run_all(next(passes))), args.reps)
    finally:
        llm.shutdown()


async def _async_llm(cls, engine_args):
    return cls.from_engine_args(engine_args)  # inside a running loop, so its output handler starts at once


# -- 2. long tail -----------------------------------------------------------------------------------
class LognormalLengths(AsyncRolloutEngine):
    """The engine actor with each request's response length drawn from a lognormal by its seed (EOS ignored)."""

    def __init__(self, *args, median: float, sigma: float, cap: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.median, self.sigma, self.cap = median, sigma, cap

    async def generate_one(self, request_id, request):
        z = np.random.default_rng(request.seed).standard_normal()
        length = int(np.clip(round(self.median * np.exp(self.sigma * z)), 1, self.cap))
        return await super().generate_one(request_id, replace(request, max_tokens=length, ignore_eos=True))


class ThreeTurns:
    """Writer, checker, writer; the environment replies to every turn after a lognormal delay."""

    name = "bench-three-turns"
    turn_order: ClassVar[tuple[str, ...]] = ("writer", "checker", "writer")

    def __init__(self, reply_ms: float, sigma: float) -> None:
        self.reply_s, self.sigma = reply_ms / 1000, sigma

    def sample_tasks(self, rng: np.random.Generator, count: int) -> list[dict]:
        return [{"id": int(rng.integers(1 << 30)), "a": int(rng.integers(10)), "b": int(rng.integers(10))}
                for _ in range(count)]

    def render_prompt(self, role: str, task: dict, transcript) -> str:
        return f"{task['a']}+{task['b']}=" + "".join(turn.text[:8] for turn in transcript)

    def observe(self, role: str, task: dict, transcript) -> str:
        if self.reply_s > 0:
            z = np.random.default_rng([task["id"], len(transcript)]).standard_normal()
            time.sleep(self.reply_s * np.exp(self.sigma * z))
        return "noted"


def long_tail(ray, model_dir: str, args) -> dict[str, float]:
    from marl_pipeline.config import RolloutConfig
    from marl_pipeline.stages.rollout import RolloutSettings
    from marl_pipeline.stages.trajectories import rollout_trajectories
    from marl_pipeline.store import MicroBatchKey
    from tests.turn_batched import rollout_micro_batch

    actor = ray.remote(LognormalLengths).options(num_cpus=0.5, runtime_env={"env_vars": ENGINE_ENV}).remote(
        model_dir, 0, gpu_memory_utilization=GPU_MEMORY_UTILIZATION, max_model_len=args.max_model_len,
        dtype=args.dtype, seed=SEED, threads=args.threads, median=args.length_median, sigma=args.length_sigma,
        cap=args.max_model_len // 2)
    ray.get(actor.policy_version.remote())
    engines = {"writer": actor, "checker": actor}
    settings = RolloutSettings(SEED, args.tail_prompts, args.tail_samples, dict.fromkeys(engines, args.max_tokens),
                               dict.fromkeys(engines, 1.0))
    episodes = args.tail_prompts * args.tail_samples
    modes = {"turn-batched": lambda env, key: rollout_micro_batch(env, engines, key, settings),
             "trajectory": lambda env, key: rollout_trajectories(env, engines, key, settings, RolloutConfig())}
    rates = {}
    try:
        for scenario, reply_ms in (("lengths + replies", args.reply_ms), ("lengths only", 0.0)):
            env = ThreeTurns(reply_ms, args.reply_sigma)
            for rollout in modes.values():  # untimed: one-off set-up of batch shapes, threads, Ray's awaits
                rollout(env, MicroBatchKey("warm", 0, 0))
            seconds = {mode: 0.0 for mode in modes}
            for mb in range(args.tail_micro_batches):  # the same micro-batches in both modes, alternating
                key = MicroBatchKey("tail", 0, mb)
                for mode, rollout in modes.items():
                    start = time.perf_counter()
                    table = rollout(env, key)
                    seconds[mode] += time.perf_counter() - start
                    tokens = sum(len(ids) for ids in table.column("response_ids").to_pylist())
                    print(f"    {scenario}, micro-batch {mb}, {mode}: {time.perf_counter() - start:.2f} s, "
                          f"{tokens} tokens ({load()})", flush=True)
            for mode in modes:
                rates[f"{scenario}: {mode}"] = episodes * args.tail_micro_batches / seconds[mode]
    finally:
        ray.kill(actor)
        time.sleep(5)
    return rates


# -- 3. routing -------------------------------------------------------------------------------------
def routing_cache_gib(model_dir: str, args) -> float | None:
    """Each replica's KV cache for ``--route-cache``: that many times what sticky routing holds per replica at its
    peak (its half of the episodes in flight at their longest, in whole blocks); None (0): the memory share's
    cache, no pressure."""
    if not args.route_cache:
        return None
    from marl_pipeline.policy.checkpoint import kv_cache_bytes_per_token

    token_bytes = kv_cache_bytes_per_token(model_dir)  # float32
    # the last turn's sequence: the context, every turn's response, the 8-token reply between turns
    episode_tokens = args.route_context + args.route_turns * args.route_tokens + (args.route_turns - 1) * 8
    blocks = -(-episode_tokens // CPU_BLOCK_TOKENS) * -(-args.route_episodes // 2)
    gib = args.route_cache * blocks * CPU_BLOCK_TOKENS * token_bytes / 2**30
    print(f"  KV cache per replica {gib * 2**30 / token_bytes:.0f} tokens ({args.route_cache} x sticky's "
          f"{blocks} blocks of {CPU_BLOCK_TOKENS})", flush=True)
    return gib


def routing(ray, model_dir: str, args) -> dict[str, dict[str, float]]:
    from marl_pipeline.cluster.spawn import engine_actor
    from marl_pipeline.config import EngineConfig
    from marl_pipeline.inference.router import Router
    from tests.round_robin import RoundRobinRouter

    threads = max(1, args.threads // 2)
    kv_cache_gib = routing_cache_gib(model_dir, args)
    actor = engine_actor(EngineConfig(num_cpus=0), actor_class=AsyncRolloutEngine)
    replicas = [actor.remote(model_dir, 0, gpu_memory_utilization=ROUTING_MEMORY, max_model_len=args.max_model_len,
                             dtype=args.dtype, seed=SEED, threads=threads, kv_cache_gib=kv_cache_gib)
                for _ in range(2)]
    ray.get([r.policy_version.remote() for r in replicas])

    async def episode(router: Router, e: int, rng: np.random.Generator, tag: str) -> int:
        prompt, generated = [int(t) for t in rng.integers(5, 100, args.route_context)], 0
        for turn in range(args.route_turns):
            while (replica := router.acquire(e)) is None:
                await asyncio.sleep(0.005)
            try:
                sampled = await replicas[replica].generate_one.remote(
                    f"{tag}-{e}-{turn}", GenerationRequest(prompt, e * 100 + turn, args.route_tokens, 1.0,
                                                           ignore_eos=True))
            finally:
                router.release(replica)
            response = sampled.completion.response_ids
            generated += len(response)
            prompt = prompt + response + [int(t) for t in rng.integers(5, 100, 8)]
        return generated

    async def run_pass(policy: str, n: int) -> int:
        router = RoundRobinRouter(2) if policy == "round_robin" else Router(2)
        return sum(await asyncio.gather(*[episode(router, e, np.random.default_rng([SEED, n, e]), f"{policy}-{n}")
                                          for e in range(args.route_episodes)]))

    def stats() -> tuple[int, int]:
        counts = ray.get([r.prefix_cache_stats.remote() for r in replicas])
        return sum(c["queries"] for c in counts), sum(c["hits"] for c in counts)

    totals = {policy: {"seconds": 0.0, "tokens": 0, "queries": 0, "hits": 0} for policy in ("sticky", "round_robin")}
    try:
        for policy in totals:  # untimed: set-up of batch shapes
            asyncio.run(run_pass(policy, 0))
        n = 1
        for rep in range(args.reps):
            for policy, total in totals.items():
                queries, hits = stats()
                start = time.perf_counter()
                tokens = asyncio.run(run_pass(policy, n))
                seconds = time.perf_counter() - start
                after = stats()
                total["seconds"] += seconds
                total["tokens"] += tokens
                total["queries"] += after[0] - queries
                total["hits"] += after[1] - hits
                print(f"    pass {rep}, {policy}: {seconds:.2f} s, {tokens} tokens, prefix-cache hits "
                      f"{after[1] - hits}/{after[0] - queries} ({load()})", flush=True)
                n += 1
    finally:
        for r in replicas:
            ray.kill(r)
        time.sleep(5)
    return {policy: {"hit_rate": t["hits"] / max(t["queries"], 1), "tokens_per_s": t["tokens"] / t["seconds"]}
            for policy, t in totals.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="'tiny' (the built-in model) or a model source")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--tail-prompts", type=int, default=8)
    parser.add_argument("--tail-samples", type=int, default=4)
    parser.add_argument("--tail-micro-batches", type=int, default=3)
    parser.add_argument("--length-median", type=float, default=16)
    parser.add_argument("--length-sigma", type=float, default=1.0)
    parser.add_argument("--reply-ms", type=float, default=50)
    parser.add_argument("--reply-sigma", type=float, default=1.0)
    parser.add_argument("--route-episodes", type=int, default=32)
    parser.add_argument("--route-turns", type=int, default=4)
    parser.add_argument("--route-context", type=int, default=100)
    parser.add_argument("--route-tokens", type=int, default=64)
    parser.add_argument("--route-cache", type=float, default=1.0,
                        help="each replica's KV cache as a multiple of what sticky routing holds on it at its peak "
                             "(its half of the episodes in flight at their longest); 0: the memory share's cache "
                             "(~1M tokens), no pressure")
    parser.add_argument("--skip", choices=["overhead", "tail", "routing"], action="append", default=[],
                        help="leave a part out (repeatable)")
    args = parser.parse_args()

    import ray

    model_dir = model_directory(args.model)
    print(f"{model_dir}: {args.dtype}, {args.threads} threads ({load()})", flush=True)
    overhead, rates, routes = {}, {}, {}
    ray.init(num_cpus=args.threads, include_dashboard=False, log_to_driver=False)
    try:
        if "routing" not in args.skip:
            print(f"routing: 2 replicas, {args.route_episodes} episodes x {args.route_turns} turns, context "
                  f"{args.route_context} tokens, responses {args.route_tokens} tokens", flush=True)
            routes = routing(ray, model_dir, args)
        if "tail" not in args.skip:
            print(f"long tail: {args.tail_micro_batches} micro-batches of {args.tail_prompts} x {args.tail_samples} "
                  f"episodes, lengths lognormal({args.length_median}, {args.length_sigma}), replies "
                  f"lognormal({args.reply_ms} ms, {args.reply_sigma})", flush=True)
            rates = long_tail(ray, model_dir, args)
        if "overhead" not in args.skip:
            print(f"overhead: {args.prompts * args.samples} requests x {args.max_tokens} tokens; ours "
                  "(AsyncRolloutEngine actor, one call per request) and in-process (vLLM's LLMEngine in this "
                  "process, add_request + step), alternating:", flush=True)
            overhead = overhead_side_by_side(ray, model_dir, args)
            gc.collect()  # the in-process engine goes with the function's frame, before AsyncLLM starts
    finally:
        ray.shutdown()
    if "overhead" not in args.skip:
        print("  bare (AsyncLLM in this process, one stream per request):", flush=True)
        overhead["bare"] = overhead_bare(model_dir, args)  # last: its engine goes with the process

    print(f"\nresults ({load()}):")
    if overhead:
        tokens_per_s = {name: tokens / statistics.median(s) for name, (s, tokens) in overhead.items()}
        for name, (s, tokens) in overhead.items():
            print(f"  overhead {name:>10}: {tokens_per_s[name]:8.1f} tokens/s ({tokens} tokens, passes "
                  f"{[round(x, 2) for x in s]} s)")
        print(f"  overhead ours / in-process (the bar): {tokens_per_s['ours'] / tokens_per_s['in-process']:.3f}")
        print(f"  overhead ours / bare AsyncLLM (its engine core in other processes): "
              f"{tokens_per_s['ours'] / tokens_per_s['bare']:.3f}")
    for name, rate in rates.items():
        print(f"  {name}: {rate:.2f} episodes/s")
    for scenario in ("lengths + replies", "lengths only"):
        if f"{scenario}: trajectory" in rates:
            ratio = rates[f"{scenario}: trajectory"] / rates[f"{scenario}: turn-batched"]
            print(f"  {scenario}: trajectory / turn-batched: {ratio:.2f}x")
    for policy, figures in routes.items():
        print(f"  routing {policy:>11}: prefix-cache hit rate {figures['hit_rate']:.3f}, "
              f"{figures['tokens_per_s']:.1f} tokens/s")
    if routes:
        sticky, robin = routes["sticky"], routes["round_robin"]
        print(f"  routing sticky / round-robin: hit rate {sticky['hit_rate'] / max(robin['hit_rate'], 1e-9):.2f}x, "
              f"throughput {sticky['tokens_per_s'] / robin['tokens_per_s']:.2f}x")


if __name__ == "__main__":
    main()
