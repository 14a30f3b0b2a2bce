"""Trainer precision: float32, or bfloat16 autocast over float32 master weights where the hardware has bf16.

Autocast rather than pure-bf16 parameters: its logprobs are closer to float32, and the parameters, gradients and
AdamW state stay float32, so an update smaller than 2^-8 of a weight is not rounded away and weight sync and
checkpoints are unchanged. On a CPU without AMX or AVX512-BF16 bf16 matmuls are emulated and several times slower,
which is why ``auto`` asks the hardware.
"""

from __future__ import annotations

import contextlib
import platform
from pathlib import Path

import torch

_CPU_BF16_FLAGS = ("amx_bf16", "avx512_bf16")


def cpu_has_bf16(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """Whether this CPU computes bf16 natively (AMX or AVX512-BF16), rather than emulating it in float32."""
    try:
        text = cpuinfo.read_text()
    except OSError:  # not Linux: ask torch (private helpers, absent in some builds)
        return any(getattr(torch.cpu, name, lambda: False)()
                   for name in ("_is_amx_tile_supported", "_is_avx512_bf16_supported"))
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return any(flag in flags for flag in _CPU_BF16_FLAGS)


def cpu_name(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """This CPU's model name, as benchmarks record it beside their figures (``unknown`` where none is stated)."""
    try:
        text = cpuinfo.read_text()
    except OSError:  # not Linux
        return platform.processor() or "unknown"
    return next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")),
                "unknown")


def resolve_dtype(dtype: str, device_type: str) -> torch.dtype:
    """``float32``, ``bfloat16`` or ``auto`` (bf16 where ``device_type`` has it) as a torch dtype."""
    if dtype == "float32":
        return torch.float32
    if dtype == "bfloat16":
        return torch.bfloat16
    if dtype != "auto":
        raise ValueError(f"dtype {dtype!r}: expected 'float32', 'bfloat16' or 'auto'")
    has_bf16 = torch.cuda.is_bf16_supported() if device_type == "cuda" else cpu_has_bf16()
    return torch.bfloat16 if has_bf16 else torch.float32


def autocast(dtype: torch.dtype, device_type: str):
    """The context a forward pass runs in: bf16 autocast, or nothing for float32 (today's exact numbers)."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, dtype=dtype)
