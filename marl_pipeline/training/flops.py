"""A trainer's model FLOPs utilization (MFU): the work its passes did against what its device can do.

The work is the usual 6 x parameters x tokens (forward 2, backward 4 FLOPs per parameter and token: PaLM's
appendix B, verl's ``perf/mfu/actor``, torchtitan's), counting every real token the passes computed, prompts
included, padding not. It leaves out attention's score matrices and counts the output head at every token
although the trainer computes it at response tokens alone, so the figure compares runs and bounds, not kernels.
The device's peak is measured once per trainer and precision (a square matmul, what a GPU's spec sheet promises
and rarely gives: 790 of 989 bf16 TFLOP/s on an H200), and per thread count on a CPU, whose cores the split moves.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

_PEAKS: dict[tuple, float] = {}


@dataclass
class StepWork:
    """What a trainer's passes computed since its last optimizer step: real tokens, and the seconds they took."""

    tokens: int = 0
    seconds: float = 0.0

    def add(self, tokens: int, began: float) -> None:
        """``tokens`` computed since ``began`` (``time.perf_counter()``)."""
        self.tokens += tokens
        self.seconds += time.perf_counter() - began

    def figures(self, parameters: int, peak: float, tokens: int, seconds: float, workers: int = 1) -> dict:
        """The step's ``StepResult`` figures: ``tokens`` over every worker in ``seconds`` (one worker's, the passes'
        and the optimizer's), against ``workers`` devices of ``peak`` FLOP/s."""
        return {"computed_tokens": tokens, "compute_seconds": seconds,
                "tokens_per_second": tokens / seconds if seconds else 0.0,
                "mfu": training_flops(parameters, tokens) / seconds / (peak * workers) if seconds else 0.0,
                "peak_tflops": peak / 1e12}


def training_flops(parameters: int, tokens: int) -> float:
    """FLOPs of a forward and backward pass over ``tokens`` tokens of a model of ``parameters`` parameters."""
    return 6.0 * parameters * tokens


def peak_flops(device: torch.device, dtype: torch.dtype) -> float:
    """The device's measured matmul FLOP/s in ``dtype`` (best of a few square products), cached per process."""
    threads = torch.get_num_threads() if device.type == "cpu" else 0
    key = (str(device), dtype, threads)
    if key not in _PEAKS:
        size, repeats = (8192, 10) if device.type == "cuda" else (512, 4)
        a, b = (torch.randn(size, size, device=device, dtype=dtype) for _ in range(2))
        best = float("inf")
        for _ in range(repeats + 1):  # the first is the warm-up: kernel choice, allocation
            synchronize(device)
            began = time.perf_counter()
            a @ b
            synchronize(device)
            best = min(best, time.perf_counter() - began)
        _PEAKS[key] = 2.0 * size**3 / best
    return _PEAKS[key]


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on a CPU, whose work is done when the call returns)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
