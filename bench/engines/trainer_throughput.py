"""Benchmark: the trainer actor's real-token throughput against a bare torch forward/backward loop.

Side by side in one process, rep by rep, on the same rows (lengths varying within the micro-batch), in float32
on the same number of threads, with the same optimizer step (AdamW, gradients divided by the token count,
norm clipped at 1):

- **ours**: ``PolicyTrainer`` in a Ray actor spawned as ``cluster/spawn.py`` spawns it (``trainer_actor``),
  one ``accumulate`` of the micro-batch and one ``apply_step``;
- **bare, unpadded**: ``AutoModelForCausalLM`` in this process, one row at a time (no padding at all), the same
  clipped policy-gradient loss summed over response tokens, then the step;
- **bare, padded**: the same with the micro-batch as one right-padded tensor (what the trainer did before);
- **before** (``--before``): the trainer actor as it was spawned before this benchmark (one thread, as Ray gives
  a 0.5-CPU actor, and the micro-batch as one padded pass).

Real tokens are prompt + response tokens (padding excluded); every variant is charged the same count.

    .venv/bin/python -m bench.engines.trainer_throughput --rows 32 --threads 2 --reps 3 --before
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from marl_pipeline.planner.profiling import synthetic_batch
from marl_pipeline.training.batches import TrainBatch
from marl_pipeline.training.losses import pad_sequences

LR, CLIP_EPS, MAX_GRAD_NORM = 1e-6, 0.2, 1.0


def _pg_loss(model, input_ids, attention_mask, response_mask, old, advantages) -> tuple[torch.Tensor, int]:
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1].float()
    logprobs = torch.gather(torch.log_softmax(logits, dim=-1), 2, input_ids[:, 1:, None]).squeeze(-1)
    ratio = torch.exp(logprobs - old)
    adv = advantages[:, None]
    loss = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - CLIP_EPS, 1 + CLIP_EPS))
    return (loss * response_mask).sum(), int(response_mask.sum())


def _engine_logprobs(batch: TrainBatch, rows: list[int], mask: torch.Tensor) -> torch.Tensor:
    old = torch.zeros_like(mask)
    for position, row in enumerate(rows):
        start = len(batch.prompt_ids[row]) - 1
        old[position, start: start + len(batch.old_logprobs[row])] = torch.tensor(batch.old_logprobs[row])
    return old


def bare_step(model, optimizer, batch: TrainBatch, padded: bool) -> None:
    """One optimizer step over the micro-batch, in plain torch: one padded tensor, or row by row."""
    groups = [list(range(len(batch.prompt_ids)))] if padded else [[row] for row in range(len(batch.prompt_ids))]
    tokens = 0
    for rows in groups:
        input_ids, attention_mask, mask = pad_sequences([batch.prompt_ids[r] for r in rows],
                                                        [batch.response_ids[r] for r in rows], 0)
        advantages = torch.tensor([batch.advantages[r] for r in rows], dtype=torch.float32)
        loss, count = _pg_loss(model, input_ids, attention_mask, mask, _engine_logprobs(batch, rows, mask),
                               advantages)
        loss.backward()
        tokens += count
    bare_optimizer_step(model, optimizer, tokens)


def bare_optimizer_step(model, optimizer, tokens: int) -> None:
    """The trainer's optimizer step in plain torch: gradients divided by the token count, norm clipped, AdamW."""
    for param in model.parameters():
        if param.grad is not None:
            param.grad.div_(max(tokens, 1))
    torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="a model source (bootstrap/model_sources.py)")
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, nargs=2, default=(16, 96), metavar=("MIN", "MAX"))
    parser.add_argument("--response-tokens", type=int, nargs=2, default=(4, 64), metavar=("MIN", "MAX"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--chunk-tokens", type=int, default=None, help="default: TrainerConfig's")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--before", action="store_true", help="also the trainer as spawned before (1 thread, 1 pass)")
    args = parser.parse_args()

    import ray
    from transformers import AutoModelForCausalLM

    from marl_pipeline.bootstrap.model_sources import resolve_model_source
    from marl_pipeline.cluster.spawn import trainer_actor
    from marl_pipeline.config import TrainerConfig

    model_dir = resolve_model_source(args.model)
    torch.set_num_threads(args.threads)
    settings = TrainerConfig(threads=args.threads, lr=LR, max_grad_norm=MAX_GRAD_NORM,
                             **({"chunk_tokens": args.chunk_tokens} if args.chunk_tokens else {}))
    bare = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    bare.train()
    optimizer = torch.optim.AdamW(bare.parameters(), lr=LR, weight_decay=0.0)
    batch = synthetic_batch(args.rows, bare.config.vocab_size, args.prompt_tokens, args.response_tokens)
    lengths = [len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids)]
    real = sum(lengths)
    print(f"{model_dir}\n{args.rows} rows, lengths {min(lengths)}-{max(lengths)}, {real} real tokens, "
          f"{args.rows * max(lengths)} padded as one tensor; {args.threads} threads; "
          f"chunk_tokens {settings.chunk_tokens}; cpu {os.cpu_count()}", flush=True)

    ray.init(num_cpus=args.threads, include_dashboard=False, log_to_driver=False)
    common = dict(lr=LR, weight_decay=0.0, max_grad_norm=MAX_GRAD_NORM, clip_eps=CLIP_EPS, seed=0, dtype="float32")
    actors = {"ours": trainer_actor(settings).remote(model_dir, 0, num_threads=settings.threads,
                                                      chunk_tokens=settings.chunk_tokens, **common)}
    if args.before:  # Ray's thread for a 0.5-CPU actor (num_threads None), the micro-batch as one pass
        actors["before"] = trainer_actor(TrainerConfig()).remote(model_dir, 0, num_threads=None,
                                                                 chunk_tokens=10**9, **common)
    ray.get([actor.policy_version.remote() for actor in actors.values()])

    def run_actor(name: str, rows: TrainBatch) -> None:
        ray.get(actors[name].accumulate.remote(rows))
        ray.get(actors[name].apply_step.remote())

    variants = {name: (lambda b, name=name: run_actor(name, b)) for name in actors}
    variants["bare, unpadded"] = lambda b: bare_step(bare, optimizer, b, padded=False)
    variants["bare, padded"] = lambda b: bare_step(bare, optimizer, b, padded=True)
    warm = TrainBatch(batch.prompt_ids[:2], batch.response_ids[:2], batch.old_logprobs[:2], batch.advantages[:2])
    seconds: dict[str, list[float]] = {name: [] for name in variants}
    for rep in range(args.reps + 1):  # rep 0 warms every variant up on two rows
        for name, step in variants.items():
            start = time.perf_counter()
            step(batch if rep else warm)
            if rep:
                seconds[name].append(time.perf_counter() - start)
                print(f"  rep {rep} {name}: {seconds[name][-1]:.1f} s (load {os.getloadavg()[0]:.1f})", flush=True)
    rates = {name: real / statistics.median(times) for name, times in seconds.items()}
    for name, rate in rates.items():
        print(f"{name:>15}: {rate:6.1f} real tokens/s (median of {args.reps}; "
              f"{[round(t, 1) for t in seconds[name]]} s)")
    for bare_name in ("bare, unpadded", "bare, padded"):
        for name in actors:
            print(f"{name} / {bare_name}: {rates[name] / rates[bare_name]:.2f}")
    ray.shutdown()


if __name__ == "__main__":
    main()
