"""An engine's measured costs: vLLM's decode step by batch and context length, and its prefill by tokens, as ``marl
profile engine`` writes them (planner/profiling.py); fitted into the simulation's ``EngineCosts`` in place of a
roofline.

The format (JSON)::

    {"gpu": "NVIDIA H100 80GB HBM3", "model": "...", "tensor_parallel": 1,
     "decode": [{"batch": 64, "context": 1024, "step_seconds": 0.0121}, ...],
     "prefill": [{"tokens": 8192, "seconds": 0.051}, ...]}

A decode step is fitted as ``step + batch x (per_sequence + per_context_token x context)`` (least squares over the
points), and taken at the engines' typical context; prefill as ``fixed + per_prompt_token x tokens``, of which the
slope is kept (the fixed part is a step's, counted already).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from marl_pipeline.planner.costs import EngineCosts


def engine_profile(path: str | Path, context_tokens: int = 1024) -> EngineCosts:
    """The costs a profile measured, a decoding sequence's taken at ``context_tokens`` of context.

    Raises:
        ValueError: the file is not such a profile (naming what is missing), or its points cannot be fitted.
    """
    path = Path(path)
    try:
        data = json.loads(path.read_text())
        decode = [(float(p["batch"]), float(p["context"]), float(p["step_seconds"])) for p in data["decode"]]
        prefill = [(float(p["tokens"]), float(p["seconds"])) for p in data["prefill"]]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(f"engine profile {path}: expected JSON with decode points (batch, context, step_seconds) "
                         f"and prefill points (tokens, seconds) ({type(error).__name__}: {error})") from None
    if len({(b, c) for b, c, _ in decode}) < 3 or len({t for t, _ in prefill}) < 2:
        raise ValueError(f"engine profile {path}: {len(decode)} decode and {len(prefill)} prefill points; the fit "
                         f"needs 3 decode points of distinct batch and context and 2 prefill points of distinct "
                         f"tokens")
    x = np.array([[1.0, batch, batch * context] for batch, context, _ in decode])
    step, per_sequence, per_context = np.linalg.lstsq(x, np.array([s for *_, s in decode]), rcond=None)[0]
    per_prompt_token, _ = np.polyfit([t for t, _ in prefill], [s for _, s in prefill], 1)
    return EngineCosts(step=max(float(step), 0.0),
                       per_sequence=max(float(per_sequence + per_context * context_tokens), 0.0),
                       per_prompt_token=max(float(per_prompt_token), 0.0))
