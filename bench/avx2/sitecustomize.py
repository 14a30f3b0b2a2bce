"""Every process started with this directory on ``PYTHONPATH`` (and every process they start: Ray's workers, vLLM's
engines) computes on the AVX2 code paths of torch (``ATEN_CPU_CAPABILITY``), oneDNN, MKL and vLLM's CPU kernels,
on a host that has AVX512. That is one more float order to check a learning claim on, not an AVX2 host's own: the
filing's AVX2-only AMD EPYC made another version 0 again (BENCHMARKS.md, "Default training run").

    PYTHONPATH=$PWD/bench/avx2 .venv/bin/python -m bench.learning.seeds configs/demo.yaml --seeds 0 1 2 3 4 \\
        --out /tmp/seeds-avx2.json

Python imports a ``sitecustomize`` it finds on its module path once, at start-up: before torch.
"""

import importlib.abc
import importlib.machinery
import os
import sys

for name, value in {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "DNNL_MAX_CPU_ISA": "AVX2",
                    "MKL_ENABLE_INSTRUCTIONS": "AVX2"}.items():
    os.environ.setdefault(name, value)


class _CpuWithoutAvx512(importlib.abc.MetaPathFinder):
    """``torch.cpu`` answering that the CPU has no AVX512: vLLM loads its AVX2 kernels (``vllm._C_AVX2``) then."""

    def find_spec(self, name, path, target=None):
        if name != "torch.cpu":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None:
            return None
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            for check in ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_avx512_vnni_supported",
                          "_is_amx_tile_supported"):
                setattr(module, check, lambda: False)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _CpuWithoutAvx512())
