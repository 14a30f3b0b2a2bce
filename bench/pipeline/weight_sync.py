"""Benchmark: weight sync from a trainer actor to 1 and to 3 engine replicas, through Ray's object store
(``ray.weight_sync: object_store``) against a torch.distributed broadcast (``broadcast``: policy/transfer.py).

Side by side in one Ray instance, rep by rep, on the same weights: the trainer takes an optimizer step, then each
path syncs that version into every replica (``EngineReplicas.load_weights`` / ``broadcast_weights``, as the
orchestrator calls them). Reported per path: seconds per sync (from the trainer's step to every replica serving it,
median over reps), the peak of the machine's used memory during the sync above the level before it (sampled every
10 ms: the object store's shared memory, the copies in every process), and the largest difference between an
engine's and the trainer's log-probabilities after the sync.

    .venv/bin/python -m bench.pipeline.weight_sync --model smollm2-135m-instruct --replicas 1 3 --reps 3
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from functools import partial

import psutil


class PeakMemory:
    """The machine's used memory, sampled on a thread; ``peak`` is the largest rise above the level at start."""

    def __enter__(self) -> PeakMemory:
        self.base, self.peak, self._stop = psutil.virtual_memory().used, 0, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, psutil.virtual_memory().used - self.base)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def run(model_dir: str, replicas: int, reps: int) -> dict[str, dict]:
    import ray

    from marl_pipeline.cluster.spawn import engine_actor
    from marl_pipeline.cluster.trainers import TrainerActor, remote_trainer
    from marl_pipeline.config import EngineConfig
    from marl_pipeline.inference.async_engine import AsyncRolloutEngine
    from marl_pipeline.inference.replicas import EngineReplicas
    from marl_pipeline.training.batches import TrainBatch

    trainer = remote_trainer(TrainerActor).options(num_cpus=0).remote(
        model_dir, 0, lr=1e-3, weight_decay=0.0, max_grad_norm=1.0, clip_eps=0.2, seed=0, num_threads=2)
    actor = engine_actor(EngineConfig(num_cpus=0), actor_class=AsyncRolloutEngine)
    handles = [actor.remote(model_dir, 0, gpu_memory_utilization=0.05, max_model_len=128, dtype="float32", seed=0,
                            threads=1, kv_cache_gib=0.05) for _ in range(replicas)]
    engines = EngineReplicas("bench", handles, version=0)
    ray.get([h.policy_version.remote() for h in handles] + [trainer.policy_version.remote()])
    address = ray.get(trainer.weights_address.remote())
    prompt, response = [17, 11, 18, 29, 40, 41], [20, 0, 33]
    results = {"object_store": {"seconds": [], "peak_gib": [], "max_logprob_diff": []},
               "broadcast": {"seconds": [], "peak_gib": [], "max_logprob_diff": []}}
    for rep in range(reps):
        old = ray.get(trainer.completion_logprobs.remote(prompt, response))
        ray.get(trainer.accumulate.remote(TrainBatch([prompt], [response], [old], [1.0])))
        version = ray.get(trainer.apply_step.remote()).policy_version
        expected = ray.get(trainer.completion_logprobs.remote(prompt, response))
        order = ["object_store", "broadcast"] if rep % 2 == 0 else ["broadcast", "object_store"]
        for path in order:
            with PeakMemory() as memory:
                started = time.perf_counter()
                if path == "object_store":
                    engines.load_weights(trainer.named_weights.remote(), version)
                else:
                    layout = ray.get(trainer.stage_weights.remote())
                    engines.broadcast_weights(address, partial(trainer.send_weights.remote, version=version), layout,
                                              version, trainer.staged_weights.remote)
                seconds = time.perf_counter() - started
            served = ray.get([h.completion_logprobs.remote(prompt, response) for h in handles])
            results[path]["seconds"].append(seconds)
            results[path]["peak_gib"].append(memory.peak / 2**30)
            results[path]["max_logprob_diff"].append(max(abs(a - b) for s in served for a, b in zip(s, expected)))
            print(f"  rep {rep} {path:>12}: {seconds:.3f} s, peak +{memory.peak / 2**30:.2f} GiB, "
                  f"max |engine - trainer| {results[path]['max_logprob_diff'][-1]:.2e}", flush=True)
    engines.shutdown()
    ray.kill(trainer)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="a model source (bootstrap/model_sources.py)")
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 3])
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()

    import ray

    from marl_pipeline.bootstrap.model_sources import resolve_model_source

    model_dir = str(resolve_model_source(args.model))
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    summary = []
    try:
        for replicas in args.replicas:
            print(f"{model_dir}: {replicas} replica(s)", flush=True)
            for path, figures in run(model_dir, replicas, args.reps).items():
                summary.append((replicas, path, statistics.median(figures["seconds"]), max(figures["peak_gib"]),
                                max(figures["max_logprob_diff"])))
    finally:
        ray.shutdown()
    print("replicas  path          s/sync (median)  peak GiB (max)  max |engine - trainer|")
    for replicas, path, seconds, peak, diff in summary:
        print(f"{replicas:>8}  {path:<12}  {seconds:15.3f}  {peak:14.2f}  {diff:.2e}")


if __name__ == "__main__":
    main()
