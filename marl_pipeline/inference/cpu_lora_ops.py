"""vLLM 0.32's CPU LoRA ops, grouped by adapter: what an engine serving named adapters on some requests runs.

vLLM's CPU path (``PunicaWrapperCPU`` over ``vllm.lora.ops.torch_ops``) gathers each token's adapter weights,
``weights[index]``, a rank x hidden copy per token and layer, for every token of a batch once LoRA is enabled; and
a request without an adapter has index -1, whose ``weights[-1]`` is the last slot's adapter, so a batch mixing
requests with and without an adapter applies it to all (``tests/test_lora_sync.py`` has such a batch; the cost is
in docs/ARCHITECTURE.md, "Named adapters"). The replacements below do one matrix product per adapter present, over
that adapter's tokens, and add nothing for index -1 (what vLLM's GPU kernels do). Their signatures and writes to
``output_tensor`` are the originals'; :func:`install` puts them into both modules that hold the names, once per
process, before an engine with LoRA is built.
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
