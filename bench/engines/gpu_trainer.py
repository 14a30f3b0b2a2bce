"""Benchmark: the trainer on a GPU against a bare torch loop on the same GPU and batch (issue 30.6), and where its
peak memory comes from.

For each model (SmolLM2-135M's and Llama-3.2-1B's architectures, random weights, as tests/gpu builds them) and each
batch shape, in one process, alternating:

- **bare**: ``AutoModelForCausalLM``, bf16 autocast over float32 weights, the whole logits, one backward, a clipped
  fused AdamW step (what tests/gpu's bare loop does), with and without Hugging Face's activation checkpointing;
- **ours**: ``PolicyTrainer.accumulate`` then ``apply_step`` on the same rows, with and without checkpointing.

Reports seconds a step, tokens/s, ours/bare at the same checkpointing, and memory: allocated at rest (weights and
AdamW moments), the peak in an untimed step's ``accumulate`` and ``apply_step``, ``training/memory.py``'s estimate,
and the CUDA tensors held between steps beyond the weights and moments. With ``--profile``, the CPU-side operator
counts of one step of each (the small shapes are launch-bound); with ``--device-profile``, the GPU's. Runs where
tests/gpu runs (torch, transformers, peft; no Ray, vLLM or Dagster):

    python3 -m bench.engines.gpu_trainer --out results.json [--profile]

With ``--rl``, an RL-shaped micro-batch instead (issue 49): 64 rows, prompts of 256 tokens, responses drawn uniformly
from 32 to 1,024 tokens (seed 0), one step of ``PolicyTrainer.accumulate`` + ``apply_step`` in bf16 autocast, against
**the packed bound** measured in the same process: the same Hugging Face model and kernels on the same real tokens
concatenated into full 4,096-token rows (no padding, attention across the rows' seams), the head on the response
positions (the unfused chunked head), a clipped fused AdamW step. Variants of ours: ``default`` (no settings: the
budget sized to the GPU, packed passes, the fused head), ``unfused`` (the same with the old head), ``padded2048``
(the old default: padded passes of 2,048 tokens, the old head). MFU = 6 x parameters x real tokens / s over the
matmul peak measured here (training/flops.py):

    python3 -m bench.engines.gpu_trainer --rl --models llama-1b qwen2.5-3b --out rl.json
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np
import torch

from marl_pipeline.training.memory import trainer_peak_bytes
from marl_pipeline.training.trainer import PolicyTrainer
from tests.gpu.conftest import build_model_dir
from tests.gpu.test_trainer_cuda import _bare_step, _batch

SHAPES = {"16x160": (16, 96, 64), "16x768": (16, 256, 512), "32x768": (32, 256, 512)}  # rows, prompt, response tokens


def _timed(step, repeats: int) -> float:
    step()  # warm-up: kernels chosen, memory pooled
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats


def _bare(model_dir: Path, batch, checkpointing: bool, repeats: int):
    model, step = _bare_step_of(model_dir, batch, checkpointing)
    torch.cuda.reset_peak_memory_stats()
    seconds = _timed(step, repeats)
    return model, seconds, torch.cuda.max_memory_allocated()


def _ours(model_dir: Path, batch, checkpointing: bool, repeats: int):
    trainer = PolicyTrainer(str(model_dir), 0, lr=1e-5, weight_decay=0.0, max_grad_norm=1.0, clip_eps=0.2, seed=0,
                            dtype="bfloat16", device="cuda", chunk_tokens=1 << 20,
                            activation_checkpointing=checkpointing)
    seconds = _timed(_ours_step(trainer, batch), repeats)
    peaks = {}
    for name, call in (("accumulate", lambda: trainer.accumulate(batch)), ("apply_step", trainer.apply_step)):
        torch.cuda.synchronize()  # an untimed step, its phases' peaks apart
        torch.cuda.reset_peak_memory_stats()
        call()
        torch.cuda.synchronize()
        peaks[name] = torch.cuda.max_memory_allocated()
    return trainer, seconds, {"rest": torch.cuda.memory_allocated(), **peaks}


def _ours_step(trainer, batch):
    return lambda: (trainer.accumulate(batch), trainer.apply_step())


def _bare_step_of(model_dir: Path, batch, checkpointing: bool = False):
    from transformers import AutoModelForCausalLM

    from marl_pipeline.training.losses import pad_sequences

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    tensors = [t.cuda() for t in pad_sequences(batch.prompt_ids, batch.response_ids, 0)]
    advantages = torch.tensor(batch.advantages, device="cuda")
    return model, lambda: _bare_step(model, optimizer, *tensors, advantages)


def _profile(step, device: bool = False) -> list[dict]:
    """One step's operators, by CPU time (or, with ``device``, by GPU time too)."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if device else [])]
    with profile(activities=activities) as prof:
        step()
        torch.cuda.synchronize()

    def gpu_ms(event) -> float:
        return getattr(event, "self_device_time_total", getattr(event, "self_cuda_time_total", 0)) / 1e3

    rows = sorted(prof.key_averages(), key=lambda e: -(gpu_ms(e) if device else e.self_cpu_time_total))[:25]
    return [{"op": e.key, "count": e.count, "self_cpu_ms": e.self_cpu_time_total / 1e3, "self_gpu_ms": gpu_ms(e)}
            for e in rows]


def _trace(step, path: Path) -> None:
    """Two untimed steps, then a third as a chrome trace (CPU operators with Python stacks, GPU kernels), gzipped."""
    import gzip
    import shutil

    from torch.profiler import ProfilerActivity, profile

    step()
    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
        step()
        torch.cuda.synchronize()
    prof.export_chrome_trace(str(path))
    with open(path, "rb") as raw, gzip.open(f"{path}.gz", "wb") as packed:
        shutil.copyfileobj(raw, packed)
    path.unlink()


def _held(trainer) -> list[dict]:
    """CUDA tensors alive between steps that are neither the policy's parameters nor AdamW's state."""
    import gc

    known = {id(p) for p in trainer.model.parameters()}
    known |= {id(v) for state in trainer.optimizer.state.values() for v in state.values() if torch.is_tensor(v)}
    held: dict[str, int] = {}
    for obj in gc.get_objects():
        if torch.is_tensor(obj) and obj.is_cuda and id(obj) not in known:
            key = f"{tuple(obj.shape)} {obj.dtype}"
            held[key] = held.get(key, 0) + obj.numel() * obj.element_size()
    return [{"tensor": k, "gib": v / 2**30} for k, v in sorted(held.items(), key=lambda kv: -kv[1])[:10]]


RL_ROWS, RL_PROMPT, RL_RESPONSES, BOUND_ROW = 64, 256, (32, 1024), 4096


def rl_batch(seed: int = 0):
    """The RL-shaped micro-batch: prompts of 256 tokens, responses of 32 to 1,024 (uniform), random ids."""
    from marl_pipeline.training.batches import TrainBatch

    rng = np.random.default_rng(seed)
    lengths = rng.integers(RL_RESPONSES[0], RL_RESPONSES[1] + 1, size=RL_ROWS)
    prompts = [rng.integers(1, 300, size=RL_PROMPT).tolist() for _ in range(RL_ROWS)]
    responses = [rng.integers(1, 300, size=int(n)).tolist() for n in lengths]
    return TrainBatch(prompts, responses, [[-5.0] * len(r) for r in responses], rng.normal(size=RL_ROWS).tolist())


def _bound_step(model_dir: Path, batch, checkpointing: bool):
    """The packed bound's model and step: every row's tokens one stream, cut into full rows of ``BOUND_ROW`` tokens
    (the rest a shorter row of its own), SDPA's causal attention over each, today's chunked head on the response
    positions, a clipped fused AdamW step; in passes of as many rows as training/memory.py fits in the free memory, as
    the trainer sizes its own."""
    from transformers import AutoModelForCausalLM

    from marl_pipeline.training import memory
    from marl_pipeline.training.losses import scored_token_terms

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    ids, scored, weight = [], [], []
    for prompt, response, advantage in zip(batch.prompt_ids, batch.response_ids, batch.advantages):
        ids += prompt + response
        scored += [0] * (len(prompt) - 1) + [1] * len(response) + [0]  # position t predicts token t + 1
        weight += [advantage] * (len(prompt) + len(response))
    free, _ = torch.cuda.mem_get_info()
    parameters = sum(p.numel() for p in model.parameters())
    budget = memory.token_budget(memory.architecture(model), parameters=parameters, trainable=parameters,
                                 available=0.9 * (free + torch.cuda.memory_allocated()),
                                 activation_checkpointing=checkpointing)
    rows_per_pass = max(1, budget // BOUND_ROW)
    full = len(ids) // BOUND_ROW * BOUND_ROW
    parts = []
    bounds = [(low, min(low + rows_per_pass * BOUND_ROW, full), BOUND_ROW)
              for low in range(0, full, rows_per_pass * BOUND_ROW)] + [(full, len(ids), len(ids) - full)]
    for low, high, width in bounds:
        if high > low:
            tensors = (torch.tensor(values[low:high]).view(-1, width) for values in (ids, scored, weight))
            row_ids, row_scored, row_weight = (t.cuda() for t in tensors)
            parts.append((row_ids, row_scored[:, :-1].bool(), row_weight[:, :-1].float()))
    model.bound_passes = len(parts)

    def step() -> None:
        for row_ids, positions, advantages in parts:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                terms = scored_token_terms(model, row_ids, None, positions)
            (-(terms.scattered("logprobs", positions) * advantages).sum()).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return model, step


def _rl_variant(model_dir: Path, variant: str, checkpointing: bool, batch):
    """(the step, the trainer or model it holds) of one variant."""
    if variant == "bound":
        model, step = _bound_step(model_dir, batch, checkpointing)
        return step, model
    settings = {"default": {}, "unfused": {"fused_head": False},
                "padded2048": {"fused_head": False, "chunk_tokens": 2048}}[variant]
    trainer = PolicyTrainer(str(model_dir), 0, lr=1e-5, weight_decay=0.0, max_grad_norm=1.0, clip_eps=0.2, seed=0,
                            dtype="bfloat16", device="cuda", activation_checkpointing=checkpointing, **settings)
    if variant == "padded2048":  # padded passes call the packed trainer's attention without lengths: SDPA's
        trainer.passes.padded_why = "padded: the old default, for the comparison"
    results = []

    def step() -> None:
        trainer.accumulate(batch)
        results[:] = [trainer.apply_step()]

    trainer.last_result = results
    return step, trainer


def rl_main(args) -> None:
    from marl_pipeline.training.flops import peak_flops, training_flops

    batch = rl_batch()
    tokens = sum(len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids))
    peak = peak_flops(torch.device("cuda"), torch.bfloat16)
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "tokens": tokens,
               "response_tokens": sum(map(len, batch.response_ids)), "peak_tflops": peak / 1e12, "runs": []}
    print(json.dumps({key: value for key, value in results.items() if key != "runs"}), flush=True)
    with tempfile.TemporaryDirectory() as root:
        for name in args.models:
            model_dir = build_model_dir(Path(root) / name, name)
            config = json.loads((model_dir / "architecture.json").read_text())
            for checkpointing in args.checkpointing:
                for variant in args.variants:
                    run = {"model": name, "checkpointing": bool(checkpointing), "variant": variant}
                    step = holder = model = None
                    try:
                        step, holder = _rl_variant(model_dir, variant, bool(checkpointing), batch)
                        model = holder if variant == "bound" else holder.model
                        parameters = sum(p.numel() for p in model.parameters())
                        torch.cuda.reset_peak_memory_stats()
                        seconds = _timed(step, args.repeats)
                        run.update(seconds=seconds, tokens_per_s=tokens / seconds, parameters=parameters,
                                   mfu=training_flops(parameters, tokens) / seconds / peak,
                                   peak_gib=torch.cuda.max_memory_allocated() / 2**30)
                        if variant != "bound":
                            result = holder.last_result[0]
                            settings = holder.pass_settings()
                            chunks = holder.passes.chunks([len(p) + len(r) for p, r in
                                                           zip(batch.prompt_ids, batch.response_ids)])
                            largest = max(sum(len(batch.prompt_ids[r]) + len(batch.response_ids[r]) for r in chunk)
                                          for chunk in chunks)
                            estimate = trainer_peak_bytes(config, parameters=parameters, trainable=parameters,
                                                          tokens=largest, activation_checkpointing=bool(checkpointing),
                                                          fused_head=holder.passes.fused_head,
                                                          accumulated=len(chunks) > 1)
                            run.update(trainer_mfu=result.mfu, trainer_tokens_per_s=result.tokens_per_second,
                                       chunk_tokens=settings["chunk_tokens"], budget_why=settings["budget_why"],
                                       passes=settings["passes"], head=settings["head"], largest_pass=largest,
                                       pass_count=len(chunks),
                                       estimate_gib=estimate / 2**30)
                        else:
                            run["passes"] = holder.bound_passes
                    except Exception as error:  # the other variants still run; the error is the figure
                        run["error"] = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
                        run["traceback"] = traceback.format_exc().splitlines()[-12:]
                    step = holder = model = None
                    gc.collect()
                    torch.cuda.empty_cache()
                    bound = next((r for r in results["runs"] if r["model"] == name and r["variant"] == "bound"
                                  and r["checkpointing"] == run["checkpointing"] and "seconds" in r), None)
                    if bound and "seconds" in run:
                        run["of_bound"] = bound["seconds"] / run["seconds"]
                    print(json.dumps(run), flush=True)
                    results["runs"].append(run)
                    if args.out:
                        args.out.write_text(json.dumps(results, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rl", action="store_true", help="the RL-shaped micro-batch against the packed bound")
    parser.add_argument("--variants", nargs="+", default=["bound", "default", "unfused", "padded2048"])
    parser.add_argument("--checkpointing", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--models", nargs="+", default=["smollm2-135m", "llama-1b"])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--device-profile", nargs="*", default=[],
                        help="model:shape:checkpointing triples (e.g. smollm2-135m:16x768:0) to profile on the GPU")
    parser.add_argument("--trace", nargs="*", default=[],
                        help="model:shape:checkpointing triples whose steps (ours, bare) are saved as chrome traces, "
                             "with Python stacks, in --trace-dir (bench/engines/gpu_gaps.py reads them)")
    parser.add_argument("--trace-dir", type=Path, default=Path("."))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.rl:
        return rl_main(args)
    gib = 2**30
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "runs": []}
    with tempfile.TemporaryDirectory() as root:
        for name in args.models:
            model_dir = build_model_dir(Path(root) / name, name)
            config = json.loads((model_dir / "architecture.json").read_text())
            for shape in args.shapes:
                rows, prompt, response = SHAPES[shape]
                batch = _batch(rows=rows, prompt=prompt, response=response)
                tokens = rows * (prompt + response)
                for checkpointing in (False, True):
                    model, bare, bare_peak = _bare(model_dir, batch, checkpointing, args.repeats)
                    parameters = sum(p.numel() for p in model.parameters())
                    del model
                    torch.cuda.empty_cache()
                    trainer, ours, memory = _ours(model_dir, batch, checkpointing, args.repeats)
                    estimate = trainer_peak_bytes(config, parameters=parameters, trainable=parameters,
                                                  tokens=tokens, activation_checkpointing=checkpointing,
                                                  accumulated=False)  # one pass a step
                    run = {"model": name, "shape": shape, "tokens": tokens, "checkpointing": checkpointing,
                           "bare_s": bare, "ours_s": ours, "ratio": bare / ours, "ours_tokens_per_s": tokens / ours,
                           "bare_peak_gib": bare_peak / gib, "parameters": parameters,
                           **{f"{k}_gib": v / gib for k, v in memory.items()}, "estimate_gib": estimate / gib}
                    print(json.dumps(run), flush=True)
                    results["runs"].append({**run, "held": _held(trainer)})
                    if f"{name}:{shape}:{int(checkpointing)}" in args.device_profile:
                        results.setdefault("device_profiles", {})[f"{name}:{shape}:{int(checkpointing)}"] = {
                            "ours": _profile(_ours_step(trainer, batch), device=True),
                            "bare": _profile(_bare_step_of(model_dir, batch, checkpointing)[1], device=True)}
                    if (spec := f"{name}:{shape}:{int(checkpointing)}") in args.trace:
                        for who, step in (("ours", _ours_step(trainer, batch)),
                                          ("bare", _bare_step_of(model_dir, batch, checkpointing)[1])):
                            _trace(step, args.trace_dir / f"{spec.replace(':', '-')}-{who}.json")
                    if args.profile and shape == args.shapes[0] and not checkpointing:
                        results.setdefault("profiles", {})[name] = {"ours": _profile(_ours_step(trainer, batch))}
                    del trainer
                    torch.cuda.empty_cache()
            if args.profile:
                rows, prompt, response = SHAPES[args.shapes[0]]
                _, step = _bare_step_of(model_dir, _batch(rows=rows, prompt=prompt, response=response))
                results["profiles"][name]["bare"] = _profile(step)
                torch.cuda.empty_cache()
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
