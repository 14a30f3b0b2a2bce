"""vLLM 0.32's CPU LoRA ops, grouped by adapter: what an engine serving a warm-up's adapters on some turns runs.

vLLM's CPU path (``PunicaWrapperCPU`` over ``vllm.lora.ops.torch_ops``) computes each token's LoRA product by
gathering that token's adapter weights, ``weights[index]``: a rank x hidden copy per token and layer, for every
token of every request in a batch once LoRA is enabled. Two consequences for an engine that serves one adapter on
some requests (inference/engine.py, docs/ARCHITECTURE.md "A warm-up kept apart"):

- speed: in SmolLM2 verifier's RL steps, its untaught turns (workings) took about twice and its taught turns
  (verdicts) three to five times as long as on an engine without LoRA (BENCHMARKS.md, session 14);
- a request without an adapter has index -1, and ``weights[-1]`` is the last slot: with one slot, the served
  adapter, so every request of a batch that mixed taught and untaught turns got it (``tests/test_lora_sync.py``
  has such a batch).

The replacements below do one matrix product per adapter present in the batch, over that adapter's tokens, and
add nothing for index -1 (what vLLM's GPU kernels do). Their signatures and writes to ``output_tensor`` are the
originals'. They are installed into both modules that hold the names (``sgmv_*`` call ``bgmv_*`` through the ops
module; the wrapper imported all six), once per process, before an engine with LoRA is built.
"""

from __future__ import annotations

import torch


def _grouped(inputs: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Per token, ``inputs[t] @ weights[indices[t]].T``; zeros where the index is negative (no adapter)."""
    if weights.dim() == 4:
        weights = weights.squeeze(1)
    out = torch.zeros(inputs.shape[0], weights.shape[1], dtype=dtype, device=inputs.device)
    indices = indices[: inputs.shape[0]]
    for slot in torch.unique(indices).tolist():
        if slot < 0:
            continue
        rows = (indices == slot).nonzero().squeeze(1)
        out[rows] = inputs[rows].to(dtype) @ weights[slot].to(dtype).T
    return out


def bgmv_shrink(inputs, lora_a_weights, output_tensor, lora_indices_tensor, scaling: float = 1.0):
    outputs = _grouped(inputs, lora_a_weights, lora_indices_tensor, output_tensor.dtype)
    output_tensor[:, : outputs.shape[1]] = scaling * outputs[:]


def bgmv_expand(inputs, lora_b_weights, output_tensor, lora_indices_tensor, add_inputs: bool = True):
    outputs = _grouped(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    limit = output_tensor.shape[0]
    if outputs.shape[0] == 1 and output_tensor.shape[0] != 1:
        limit = 1
    common = min(outputs.shape[1], output_tensor.shape[1])
    if add_inputs:
        output_tensor[:, :common] += outputs[:limit, :common]
    else:
        output_tensor[:, :common] = outputs[:limit, :common]


def bgmv_expand_slice(inputs, lora_b_weights, output_tensor, lora_indices_tensor, slice_offset: int, slice_size: int,
                      add_inputs: bool = True):
    outputs = _grouped(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    if add_inputs:
        output_tensor[:, slice_offset : slice_offset + slice_size] += outputs[:]
    else:
        output_tensor[:, slice_offset : slice_offset + slice_size] = outputs[:]


def install() -> None:
    """Put the grouped ops in place of vLLM's CPU ones in this process (idempotent)."""
    from vllm.lora.ops.torch_ops import lora_ops
    from vllm.lora.punica_wrapper import punica_cpu

    for module in (lora_ops, punica_cpu):
        module.bgmv_shrink = bgmv_shrink
        module.bgmv_expand = bgmv_expand
        module.bgmv_expand_slice = bgmv_expand_slice
