"""vLLM's inspection of a model class, done once where a set-up can pay for it.

The first engine of an architecture on a machine has vLLM inspect the model class in a subprocess that imports torch
and vLLM (seconds on 2 cores), then caches what it found under ``VLLM_CACHE_ROOT/modelinfos``, keyed by the model
module's hash. ``scripts/setup.sh`` runs this module after installing, for the shipped models' architectures, so a
fresh machine's first launch does not pay it (BENCHMARKS.md, "First run on a fresh clone").
"""

from __future__ import annotations

import sys

SHIPPED = ("Qwen2ForCausalLM", "LlamaForCausalLM")
"""The built-in tiny model's architecture and SmolLM2's."""


def cache_model_info(architectures: tuple[str, ...] = SHIPPED) -> list[str]:
    """Inspect each architecture as vLLM does on an engine's start, filling its cache; -> those it could not."""
    from vllm.model_executor.models.registry import ModelRegistry  # its lazy registry: one subprocess per class

    return [arch for arch in architectures if ModelRegistry._try_inspect_model_cls(arch) is None]


if __name__ == "__main__":
    try:
        failed = cache_model_info(tuple(sys.argv[1:]) or SHIPPED)
    except Exception as error:  # a vLLM whose registry moved: the first launch inspects, as it would anyway
        print(f"vLLM's model-info cache not filled ({type(error).__name__}: {error})", file=sys.stderr)
        sys.exit(0)
    if failed:
        print(f"vLLM could not inspect {', '.join(failed)}", file=sys.stderr)
