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

    python3 bench/gpu_trainer.py --out results.json [--profile]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["smollm2-135m", "llama-1b"])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--device-profile", nargs="*", default=[],
                        help="model:shape:checkpointing triples (e.g. smollm2-135m:16x768:0) to profile on the GPU")
    parser.add_argument("--trace", nargs="*", default=[],
                        help="model:shape:checkpointing triples whose steps (ours, bare) are saved as chrome traces, "
                             "with Python stacks, in --trace-dir (bench/gpu_gaps.py reads them)")
    parser.add_argument("--trace-dir", type=Path, default=Path("."))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
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
                                                  tokens=tokens, activation_checkpointing=checkpointing)
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
