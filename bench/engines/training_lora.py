"""Benchmark: a LoRA trainer (peft adapters over a frozen base) against full fine-tuning, on SmolLM2-135M-Instruct.

Each variant is ``PolicyTrainer`` as the pipeline builds it (``lora`` from ``LoraAdapterConfig``, or none): two
steps (``accumulate`` of a micro-batch, ``apply_step``), the second one measured, ``named_weights`` (what
an engine reloads: merged weights for LoRA) and ``save`` (a policy version's checkpoint). Every rep runs in a fresh
child process, so its memory is its own (peaks are the kernel's high-water mark, VmHWM, reset before each phase);
the variants alternate rep by rep, so other jobs on the machine hit them alike. Reported: the process's resident
memory and its peaks, the bytes of trainable parameters, gradients and AdamW state (exact, from the tensors), the
checkpoint's size on disk, and the times.

    .venv/bin/python -m bench.engines.training_lora --rows 8 --tokens 64 --threads 2 --reps 2
    .venv/bin/python -m bench.engines.training_lora --serving --requests 16 --max-tokens 32 --threads 2

``--serving`` measures instead why engines serve merged weights rather than vLLM's own LoRA: the same seeded
requests decoded by a plain engine and by a LoRA-enabled engine with the adapters attached, one after the other.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import tempfile
import time
from pathlib import Path

VARIANTS = {"full": None, "lora r=8 all-linear": {"rank": 8, "alpha": 16.0, "target_modules": "all-linear"}}


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _reset_peak() -> None:
    """Start a new high-water mark (VmHWM) from the current resident size (Linux: clear_refs 5)."""
    Path("/proc/self/clear_refs").write_text("5")


def _tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _one_rep(model_dir: str, lora: dict | None, rows: int, tokens: int, threads: int, out) -> None:
    import torch

    from marl_pipeline.training.batches import TrainBatch
    from marl_pipeline.training.trainer import PolicyTrainer

    started = time.perf_counter()
    trainer = PolicyTrainer(model_dir, 0, lr=1e-4, weight_decay=0.0, max_grad_norm=1.0, clip_eps=0.2, seed=0,
                            num_threads=threads, lora=lora, base_dir=model_dir if lora else None)
    built_s, built_kib = time.perf_counter() - started, _status_kib("VmRSS")
    generator = torch.Generator().manual_seed(0)
    vocab = trainer.model.config.vocab_size
    prompts = [torch.randint(0, vocab, (tokens // 2,), generator=generator).tolist() for _ in range(rows)]
    responses = [torch.randint(0, vocab, (tokens // 2,), generator=generator).tolist() for _ in range(rows)]
    # The policy's own logprobs as the engine's: ratios of 1, as after a sync, so no token's gradient is clipped.
    engine = [trainer.completion_logprobs(p, r) for p, r in zip(prompts, responses)]
    advantages = [1.0 if row % 2 else -1.0 for row in range(rows)]
    batch = TrainBatch(prompts, responses, engine, advantages)
    # The second step is the one measured: from then on AdamW's moments are held while the next step's activations
    # and gradients are allocated (a first step's peak can fit the moments into memory its activations freed).
    trainer.accumulate(batch)
    trainer.apply_step()
    _reset_peak()
    started = time.perf_counter()
    trainer.accumulate(batch)
    trainer.apply_step()
    step_s = time.perf_counter() - started
    step_peak_kib, stepped_kib = _status_kib("VmHWM"), _status_kib("VmRSS")
    _reset_peak()
    trainable = [p for p in trainer.model.parameters() if p.requires_grad]
    state = [t for s in trainer.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    started = time.perf_counter()
    weights = trainer.named_weights()
    export_s = time.perf_counter() - started
    with tempfile.TemporaryDirectory() as directory:
        started = time.perf_counter()
        trainer.save(directory)
        save_s = time.perf_counter() - started
        checkpoint = sum(p.stat().st_size for p in Path(directory).iterdir())
        files = sorted(p.name for p in Path(directory).iterdir())
    out.put({"built_s": built_s, "step_s": step_s, "export_s": export_s, "save_s": save_s,
             "rss_built_mib": built_kib / 1024, "rss_step_peak_mib": step_peak_kib / 1024,
             "rss_stepped_mib": stepped_kib / 1024, "rss_export_peak_mib": _status_kib("VmHWM") / 1024,
             "trainable": sum(p.numel() for p in trainable),
             "optimizer_mib": _tensor_bytes(state) / 2**20, "grad_mib": _tensor_bytes(trainable) / 2**20,
             "exported_mib": _tensor_bytes(t for _, t in weights) / 2**20, "checkpoint_mib": checkpoint / 2**20,
             "files": files})


def _serve_rep(model_dir: str, adapter_dir: str | None, requests: int, max_tokens: int, threads: int, out) -> None:
    """Decode time of one engine: the plain one (what merged weights are served by), or vLLM's own LoRA
    (``enable_lora``, every request with a ``LoRARequest`` of the adapters). One engine alive at a time."""
    import os

    from marl_pipeline.inference.engine import ENGINE_ENV, MAX_NUM_SEQS, set_engine_threads

    os.environ.update(ENGINE_ENV)
    set_engine_threads(threads)
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    lora = {} if adapter_dir is None else {"enable_lora": True, "max_lora_rank": 8, "max_loras": 1}
    llm = LLM(model=model_dir, dtype="float32", gpu_memory_utilization=0.15, max_model_len=128, enforce_eager=True,
              seed=0, max_num_seqs=MAX_NUM_SEQS, **lora)
    request = None if adapter_dir is None else LoRARequest("adapters", 1, adapter_dir)
    params = [SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=i, ignore_eos=True) for i in range(requests)]
    prompts = [{"prompt_token_ids": [1, 504, 3458, 314, 1345 + i]} for i in range(requests)]
    times = []
    for _ in range(3):  # the first pass pays one-off set-up costs and is not counted
        started = time.perf_counter()
        llm.generate(prompts, params, lora_request=request, use_tqdm=False)
        times.append(time.perf_counter() - started)
    out.put(times[1:])


def _save_adapters(model_dir: str, directory: str) -> None:
    """Adapters with B != 0 (as after training), rank 8 on every linear layer, for vLLM's LoRA to serve."""
    import peft
    import torch

    from marl_pipeline.policy.checkpoint import load_policy

    torch.manual_seed(0)
    model = peft.get_peft_model(load_policy(model_dir)[0], peft.LoraConfig(r=8, lora_alpha=16,
                                                                           target_modules="all-linear"))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.02)
    model.save_pretrained(directory)


def serving(model_dir: str, requests: int, max_tokens: int, threads: int) -> None:
    context = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory() as adapters:
        _save_adapters(model_dir, adapters)
        for name, adapter_dir in (("plain engine (merged weights)", None), ("vLLM LoRA (enable_lora)", adapters)):
            queue = context.Queue()
            child = context.Process(target=_serve_rep, args=(model_dir, adapter_dir, requests, max_tokens, threads,
                                                             queue))
            child.start()
            times = queue.get()
            child.join()
            tokens = requests * max_tokens
            print(f"| {name} | {tokens} | {', '.join(f'{t:.2f}' for t in times)} | "
                  f"{tokens / statistics.median(times):.1f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="a model source (bootstrap/model_sources.py)")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64, help="prompt + response tokens per row (half each)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--serving", action="store_true",
                        help="instead: decode time of a plain engine against vLLM's LoRA (one engine at a time)")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    from marl_pipeline.bootstrap.model_sources import resolve_model_source

    model_dir = resolve_model_source(args.model)
    if args.serving:
        print("| engine | tokens | timed passes (s) | tokens/s (median) |\n| --- | ---: | --- | ---: |")
        serving(model_dir, args.requests, args.max_tokens, args.threads)
        return
    context = multiprocessing.get_context("spawn")
    results: dict[str, list[dict]] = {name: [] for name in VARIANTS}
    for rep in range(args.reps):
        for name, lora in VARIANTS.items():
            queue = context.Queue()
            settings = (model_dir, lora, args.rows, args.tokens, args.threads, queue)
            child = context.Process(target=_one_rep, args=settings)
            child.start()
            result = queue.get()
            child.join()
            results[name].append(result)
            print(f"rep {rep} {name}: step {result['step_s']:.2f} s, peak {result['rss_step_peak_mib']:.0f} MiB",
                  flush=True)

    print(f"\n{args.model}, {args.rows} rows x {args.tokens} tokens, {args.threads} threads, {args.reps} reps "
          f"(medians; memory in MiB)\n")
    print("| | " + " | ".join(VARIANTS) + " |")
    print("| --- |" + " ---: |" * len(VARIANTS))
    rows = [("trainable parameters", "trainable", "{:,.0f}"),
            ("gradients during the step (MiB)", "grad_mib", "{:.1f}"),
            ("AdamW state (MiB)", "optimizer_mib", "{:.1f}"),
            ("process RSS after building the trainer (MiB)", "rss_built_mib", "{:.0f}"),
            ("process peak RSS during the second step (MiB)", "rss_step_peak_mib", "{:.0f}"),
            ("process RSS after the step (MiB)", "rss_stepped_mib", "{:.0f}"),
            ("process peak RSS during named_weights + save (MiB)", "rss_export_peak_mib", "{:.0f}"),
            ("checkpoint on disk (MiB)", "checkpoint_mib", "{:.2f}"),
            ("weights sent to the engine (MiB)", "exported_mib", "{:.0f}"),
            ("second step: accumulate + apply_step (s)", "step_s", "{:.2f}"),
            ("named_weights (s)", "export_s", "{:.3f}"),
            ("save (s)", "save_s", "{:.3f}")]
    for label, key, form in rows:
        cells = [form.format(statistics.median(r[key] for r in results[name])) for name in VARIANTS]
        print(f"| {label} | " + " | ".join(cells) + " |")
    for name in VARIANTS:
        print(f"\n{name} checkpoint files: {', '.join(results[name][0]['files'])}")


if __name__ == "__main__":
    main()
