"""The profiles the planner reads, measured on this machine (``marl profile``, as vLLM has ``vllm bench``): what a
trainer's threads buy (``threads``), an engine's decode step and prefill (``engine``), a trainer's MFU on a GPU
(``gpu``), and the host's crowding exponent fitted on stored launches of several layouts (``crowding``). Each writes
the file ``marl plan`` takes (``--threads-profile``, ``--engine-profile``, ``--profile``) or the exponent to write
into a thread profile.
"""

from __future__ import annotations

import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np

from marl_pipeline.planner.plan import calibration, calibration_error, this_machine
from marl_pipeline.planner.threads import ThreadScaling
from marl_pipeline.store import ExperienceStore
from marl_pipeline.training.batches import TrainBatch

Progress = Callable[[str], None]


def synthetic_batch(rows: int, vocab: int, prompt_tokens: tuple[int, int], response_tokens: tuple[int, int],
                    seed: int | np.random.Generator = 0) -> TrainBatch:
    """An RL micro-batch of random token rows, prompt and response lengths drawn uniformly from the ranges
    (inclusive), old log-probabilities and advantages random: a trainer's work without a run. ``seed``: a seed, or a
    generator to draw on (successive batches of one benchmark)."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(1, vocab, size=rng.integers(prompt_tokens[0], prompt_tokens[1] + 1)).tolist()
               for _ in range(rows)]
    responses = [rng.integers(1, vocab, size=rng.integers(response_tokens[0], response_tokens[1] + 1)).tolist()
                 for _ in range(rows)]
    old = [(-rng.random(len(response)) * 3).tolist() for response in responses]
    return TrainBatch(prompts, responses, old, rng.normal(size=rows).tolist())


def trainer_threads(model_dir: str | Path, options: dict, batch: TrainBatch, threads: list[int], reps: int = 9,
                    progress: Progress = print) -> dict:
    """What a trainer's threads buy: one ``PolicyTrainer`` of ``model_dir`` built with ``options`` in this process,
    its ``accumulate`` of ``batch`` and ``apply_step`` timed at each count of ``threads`` in turn, rep by rep (a drift
    of the host weighs on every count alike, the order reversed every other rep). Returns the thread profile
    (planner/threads.py's format): each count's speed-up over one thread, and the cores it kept busy (its CPU
    seconds over its wall seconds, spinning threads included).

    Raises:
        ValueError: ``threads`` is not 1, 2, ... n (a profile's speed-ups are over one thread).
    """
    import torch

    from marl_pipeline.policy.precision import cpu_name
    from marl_pipeline.training.trainer import PolicyTrainer

    if list(threads) != list(range(1, len(threads) + 1)):
        raise ValueError(f"a thread profile needs the counts 1, 2, ... n, not {list(threads)}")
    before = torch.get_num_threads()
    trainer = PolicyTrainer(str(model_dir), 0, **options)
    trainer.accumulate(batch)  # untimed: first-call allocations and kernels
    trainer.apply_step()
    wall: dict[int, list[float]] = {count: [] for count in threads}
    cores: dict[int, list[float]] = {count: [] for count in threads}
    try:
        for rep in range(reps):
            for count in threads if rep % 2 == 0 else threads[::-1]:
                torch.set_num_threads(count)
                began, cpu = time.perf_counter(), time.process_time()
                trainer.accumulate(batch)
                trainer.apply_step()
                seconds = time.perf_counter() - began
                wall[count].append(seconds)
                cores[count].append((time.process_time() - cpu) / seconds)
            progress(f"rep {rep + 1}/{reps}: " + ", ".join(f"{count} threads {wall[count][-1]:.3f} s"
                                                           for count in threads))
    finally:
        torch.set_num_threads(before)
    one = statistics.median(wall[1])
    return {"cpu": cpu_name(), "command": " ".join(sys.argv), "written": time.time(),
            "seconds": {str(count): round(statistics.median(wall[count]), 4) for count in threads},
            "trainer": {str(count): round(one / statistics.median(wall[count]), 4) for count in threads},
            "cores_busy": {str(count): round(statistics.median(cores[count]), 3) for count in threads}}


BATCHES, CONTEXTS, PREFILL_TOKENS = (1, 8, 32, 64), (64, 128, 512, 1024), (1024, 4096, 8192)
"""An engine profile's points: decode batches and contexts, prefill token counts."""


def engine(model: str, tensor_parallel: int = 1, decode_tokens: int = 32, reps: int = 3, max_model_len: int = 2048,
           gpu_memory_utilization: float = 0.5, progress: Progress = print) -> dict:
    """An engine profile (planner/engine_profile.py's format): bare vLLM, eager as the project's engines run, on
    this machine's device. Decode: a batch of ``batch`` prompts of ``context`` tokens each generates
    ``decode_tokens`` tokens (ignoring end-of-sequence); its step is (the generation's seconds - the same batch's
    one-token generation) over the tokens after the first, so prefill is taken out. Prefill: a one-token generation
    of prompts adding up to the point's tokens. Each point the median of ``reps`` runs after an untimed one; token
    ids below 210, which every vocabulary has."""
    from marl_pipeline.inference.engine import ENGINE_ENV

    os.environ.update(ENGINE_ENV)
    import torch
    from vllm import LLM, SamplingParams

    llm = LLM(model, tensor_parallel_size=tensor_parallel, max_model_len=max_model_len,
              gpu_memory_utilization=gpu_memory_utilization, seed=0, enforce_eager=True)

    def seconds(prompts: list[list[int]], tokens: int) -> float:
        params = SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=1.0)
        batch = [{"prompt_token_ids": ids} for ids in prompts]
        llm.generate(batch, params, use_tqdm=False)
        runs = []
        for _ in range(reps):
            start = time.perf_counter()
            llm.generate(batch, params, use_tqdm=False)
            runs.append(time.perf_counter() - start)
        return statistics.median(runs)

    decode = []
    for context in (c for c in CONTEXTS if c + decode_tokens <= max_model_len):
        for batch in BATCHES:
            prompts = [[(7 * i + k) % 200 + 10 for k in range(context)] for i in range(batch)]
            step = (seconds(prompts, decode_tokens) - seconds(prompts, 1)) / (decode_tokens - 1)
            decode.append({"batch": batch, "context": context, "step_seconds": step})
            progress(f"decode batch {batch} context {context}: {step * 1e3:.2f} ms a step")
    prefill = []
    length = min(max_model_len - 1, 512)
    for tokens in PREFILL_TOKENS:
        prompts = [[(3 * i + k) % 200 + 10 for k in range(length)] for i in range(max(1, tokens // length))]
        prefill.append({"tokens": length * len(prompts), "seconds": seconds(prompts, 1)})
        progress(f"prefill {length * len(prompts)} tokens: {prefill[-1]['seconds'] * 1e3:.1f} ms")
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"CPU ({os.cpu_count()} cores)"
    return {"gpu": device, "model": model, "tensor_parallel": tensor_parallel, "decode": decode, "prefill": prefill}


def crowding(store: ExperienceStore, calibrate: list[str], checked: list[str], grid: list[float],
             threads: ThreadScaling | None = None) -> list[dict]:
    """The host's crowding exponent (planner/shared_cores.py) fitted on stored launches: at each exponent of
    ``grid``, the costs of the ``calibrate`` runs and each ``checked`` run (launches of other layouts, run on this
    machine) simulated again as it ran (:func:`calibration_error`); per exponent, each run's error and their
    median, max and root mean square. The fit is the exponent of least root mean square error.

    Raises:
        ValueError: an exponent outside 0..2, no checked run, or a run the calibration cannot read.
    """
    if bad := [value for value in grid if not 0 <= value <= 2]:
        raise ValueError(f"crowding exponents {bad}: each is a number from 0 to 2 (0: no loss beyond the cores)")
    if not checked:
        raise ValueError("no run to check the exponents on: give launches of layouts other than the calibration's")
    nodes, scaling = this_machine(), threads or ThreadScaling()
    found = []
    for value in grid:
        costs = calibration(store, calibrate, nodes, replace(scaling, crowding=value))
        runs = calibration_error(store, checked, nodes, costs)
        size = [abs(run["error"]) for run in runs]
        found.append({"crowding": value, "runs": runs, "median": statistics.median(size), "max": max(size),
                      "rms": math.sqrt(statistics.mean(run["error"] ** 2 for run in runs))})
    return found


GPU_BATCH = {"rows": 64, "prompt_tokens": (256, 256), "response_tokens": (32, 1024)}
"""The RL-shaped micro-batch ``gpu_trainer`` times (bench/engines/gpu_trainer.py ``--rl``'s): 64 rows, prompts of
256 tokens, responses of 32 to 1,024."""


def gpu_trainer(model_dir: str | Path, *, checkpointing: bool = False, repeats: int = 5, device: str = "cuda",
                batch: TrainBatch | None = None, progress: Progress = print) -> dict:
    """What the planner's GPU trainer costs read (``planner/profiles.trainer_profile``): this project's trainer with
    its defaults (packed passes, the token budget sized to the device, the fused head) in bf16 autocast, one
    ``accumulate`` and ``apply_step`` of an RL-shaped micro-batch (:data:`GPU_BATCH`, random tokens of the model's
    vocabulary) timed ``repeats`` times after a warm-up step, the best kept; MFU = 6 x parameters x tokens / s over
    the matmul peak measured here. ``device``: ``cpu`` runs the same steps where there is no GPU (the file's
    figures then describe this CPU, not a GPU)."""
    import torch

    from marl_pipeline.training.flops import peak_flops, synchronize, training_flops
    from marl_pipeline.training.trainer import PolicyTrainer

    trainer = PolicyTrainer(str(model_dir), 0, lr=1e-5, weight_decay=0.0, max_grad_norm=1.0, clip_eps=0.2, seed=0,
                            dtype="bfloat16", device=device, activation_checkpointing=checkpointing)
    if batch is None:
        batch = synthetic_batch(vocab=len(trainer.tokenizer), **GPU_BATCH)
    tokens = sum(len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids))
    peak = peak_flops(torch.device(device), torch.bfloat16)
    parameters = sum(p.numel() for p in trainer.model.parameters())
    times = []
    for repeat in range(repeats + 1):  # the first pays the one-off costs
        synchronize(torch.device(device))
        began = time.perf_counter()
        trainer.accumulate(batch)
        trainer.apply_step()
        synchronize(torch.device(device))
        times.append(time.perf_counter() - began)
        progress(f"step {repeat}{' (warm-up)' if repeat == 0 else ''}: {times[-1]:.3f} s")
    seconds = min(times[1:])
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    settings = trainer.pass_settings()
    run = {"model": Path(model_dir).name, "checkpointing": checkpointing, "variant": "default", "seconds": seconds,
           "tokens_per_s": tokens / seconds, "parameters": parameters,
           "mfu": training_flops(parameters, tokens) / seconds / peak, "passes": settings["passes"],
           "chunk_tokens": settings["chunk_tokens"], "head": settings["head"]}
    return {"gpu": name, "torch": torch.__version__, "tokens": tokens,
            "response_tokens": sum(map(len, batch.response_ids)), "peak_tflops": peak / 1e12, "runs": [run]}
