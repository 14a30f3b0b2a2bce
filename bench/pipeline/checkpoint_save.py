"""Benchmark: what one saved version costs the trainer actor, which saves it before the next step's first update
(``PolicyTrainer.save``: the policy in Hugging Face format and AdamW's state), full fine-tuning against LoRA.

This is the time ``pipeline.checkpoint_every: K`` takes off the trainer for K - 1 of every K versions. The store's
upload is not counted (a local store moves the directory in place).

    .venv/bin/python -m bench.pipeline.checkpoint_save --model smollm2-135m-instruct --reps 3
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="a model source (bootstrap/model_sources.py)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    from marl_pipeline.bootstrap.model_sources import resolve_model_source
    from marl_pipeline.config import LoraAdapterConfig
    from marl_pipeline.training.batches import TrainBatch
    from marl_pipeline.training.trainer import PolicyTrainer

    model_dir = str(resolve_model_source(args.model))
    for name, options in (("full", {}), ("lora", {"lora": LoraAdapterConfig().model_dump(), "base_dir": model_dir})):
        trainer = PolicyTrainer(model_dir, 0, lr=1e-5, weight_decay=0.0, max_grad_norm=1.0, clip_eps=0.2, seed=0,
                                num_threads=args.threads, **options)
        prompt, response = [17, 11, 18, 29], [20, 0]
        trainer.accumulate(TrainBatch([prompt], [response], [trainer.completion_logprobs(prompt, response)], [1.0]))
        trainer.apply_step()  # AdamW's moments exist, as in every saved version after the first
        seconds, size = [], 0
        for _ in range(args.reps):
            directory = Path(tempfile.mkdtemp(prefix="save-"))
            started = time.perf_counter()
            trainer.save(str(directory))
            seconds.append(time.perf_counter() - started)
            size = sum(path.stat().st_size for path in directory.rglob("*") if path.is_file())
            shutil.rmtree(directory)
        print(f"{name}: {statistics.median(seconds):.2f} s per save (median of {[round(s, 2) for s in seconds]}), "
              f"{size / 2**20:.0f} MiB", flush=True)


if __name__ == "__main__":
    main()
