"""A trainer's forward/backward passes over a micro-batch's rows: packed (padding-free) on a GPU, padded elsewhere.

A packed pass concatenates its rows into one sequence, restarts the positions at each row, and computes attention
per row with torch's own variable-length attention (``torch.nn.attention.varlen``: in-tree FlashAttention, bf16
or fp16, compute capability 8.0 or newer), registered for the Hugging Face model as an attention implementation; the
linear layers compute no padding. Where that cannot run (a CPU, float32, an architecture with sliding windows or
softcapped scores) the rows are sorted by length and padded to the longest of each pass, as before. :func:`choose`
is the one place that decides, and says why. Either way a :class:`Pass` holds what the loss needs in one layout,
``[rows, length - 1]`` positions (``[1, tokens - 1]`` packed), each row's response at a known span of them.
"""

from __future__ import annotations

import functools
import inspect
import itertools
from dataclasses import dataclass

import numpy as np
import torch

from marl_pipeline.training.losses import pad_sequences

VARLEN = "marl_varlen"
"""The attention implementation's name in transformers' ``AttentionInterface``: varlen attention for a packed
pass, SDPA for any other call of the same model (the padded passes of a KL reference, a warm-up's sampling)."""


@dataclass(frozen=True)
class Pass:
    """One forward/backward pass's inputs: built on the host, moved once (:meth:`to`)."""

    input_ids: torch.Tensor
    """[rows, length] padded, [1, tokens] packed."""
    attention_mask: torch.Tensor | None
    """[rows, length] padded; None packed (attention is per row by ``packing``)."""
    mask: torch.Tensor
    """[rows or 1, length - 1] float: 1 where the position predicts a response token."""
    spans: list[tuple[int, int]]
    """Per row, the flat index of its first response position and its response length."""
    packing: dict
    """The model's keyword arguments for a packed pass: restarting positions, the rows' cumulative lengths (varlen
    attention's ``cu_seq``) and the longest; empty padded."""
    tokens: int
    """Real tokens the pass computes (prompts and responses, no padding)."""

    def spread(self, values: list) -> torch.Tensor:
        """Per-row values on the response positions, zero elsewhere, in the mask's shape: a number per row (an
        advantage) fills its span, a list (the engine's log-probabilities) is laid along it."""
        flat = np.zeros(self.mask.numel(), dtype=np.float32)
        for (start, count), value in zip(self.spans, values):
            flat[start : start + count] = value if np.isscalar(value) else np.asarray(value, dtype=np.float32)[:count]
        return torch.from_numpy(flat).view(self.mask.shape)

    def loss_weights(self, normalization: str) -> torch.Tensor:
        """Each position's weight in the pass's summed loss (training/losses.py ``summed_loss``): 1 per response
        token, or 1 / its row's response length (every sequence weighs the same); host side."""
        if normalization == "token":
            return self.mask
        if normalization == "sequence":
            return self.spread([1.0 / max(count, 1) for _, count in self.spans])
        raise ValueError(f"loss normalization {normalization!r}: expected 'token' or 'sequence'")

    def counts(self) -> tuple[int, int]:
        """Response tokens and sequences with at least one (what the step divides by)."""
        return sum(count for _, count in self.spans), sum(count > 0 for _, count in self.spans)

    def to(self, device: torch.device) -> Pass:
        moved = {key: value.to(device) if torch.is_tensor(value) else value for key, value in self.packing.items()}
        return Pass(self.input_ids.to(device), None if self.attention_mask is None else self.attention_mask.to(device),
                    self.mask.to(device), self.spans, moved, self.tokens)


def padded_pass(prompts: list[list[int]], responses: list[list[int]], pad_id: int) -> Pass:
    """The rows right-padded to the longest of them."""
    input_ids, attention_mask, mask = pad_sequences(prompts, responses, pad_id)
    width = mask.shape[1]
    spans = [(row * width + len(prompt) - 1, len(response))
             for row, (prompt, response) in enumerate(zip(prompts, responses))]
    return Pass(input_ids, attention_mask, mask, spans, {}, sum(map(len, prompts)) + sum(map(len, responses)))


def packed_pass(prompts: list[list[int]], responses: list[list[int]]) -> Pass:
    """The rows one after another in one sequence, positions restarting at each."""
    if any(not prompt for prompt in prompts):
        raise ValueError("a row with an empty prompt: its first response token has no position to predict it from")
    lengths = [len(prompt) + len(response) for prompt, response in zip(prompts, responses)]
    starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    ids = np.fromiter((token for prompt, response in zip(prompts, responses) for part in (prompt, response)
                       for token in part), dtype=np.int64, count=int(starts[-1]))
    positions = np.arange(starts[-1]) - np.repeat(starts[:-1], lengths)
    spans = [(int(start) + len(prompt) - 1, len(response))
             for start, prompt, response in zip(starts, prompts, responses)]
    mask = np.zeros(max(int(starts[-1]) - 1, 0), dtype=np.float32)
    for start, count in spans:
        mask[start : start + count] = 1.0
    cumulative = torch.from_numpy(starts).to(torch.int32)
    longest = max(lengths)
    packing = {"position_ids": torch.from_numpy(positions)[None], "cu_seq_lens_q": cumulative,
               "cu_seq_lens_k": cumulative, "max_length_q": longest, "max_length_k": longest}
    return Pass(torch.from_numpy(ids)[None], None, torch.from_numpy(mask)[None], spans, packing, int(starts[-1]))


def packed_chunks(lengths: list[int], budget: int) -> list[list[int]]:
    """Row indices in order, cut into as few chunks as ``budget`` tokens allow, of about equal tokens (a row longer
    than the budget alone): passes of one size reuse the allocator's blocks, where a long pass then a short one left
    fragments that cost a pass near the memory's limit its last allocation."""
    total = sum(lengths)
    passes = max(1, -(-total // budget))
    while True:
        share = total / passes
        chunks: list[list[int]] = [[] for _ in range(passes)]
        before = 0
        for row, length in enumerate(lengths):  # each row to the share its middle falls in
            chunks[min(int((before + length / 2) // share), passes - 1)].append(row)
            before += length
        chunks = [chunk for chunk in chunks if chunk]
        largest = max((sum(lengths[row] for row in chunk) for chunk in chunks if len(chunk) > 1), default=0)
        if largest <= budget:
            return chunks
        passes = max(passes + 1, int(passes * largest / budget))


def choose(model, device: torch.device, dtype: torch.dtype) -> str | None:
    """Why this trainer's passes stay padded, or None where they can be packed (the one place that decides)."""
    if device.type != "cuda":
        return f"padded: varlen attention runs on CUDA, this trainer computes on {device.type}"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"padded: varlen attention computes in bf16 or fp16, this trainer in {str(dtype).removeprefix('torch.')}"
    if torch.cuda.get_device_capability(device) < (8, 0):
        return f"padded: varlen attention needs compute capability 8.0, {torch.cuda.get_device_name(device)} has less"
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return f"padded: torch {torch.__version__} has no torch.nn.attention.varlen"
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = base.config
    if not getattr(base, "_supports_attention_backend", False):
        return f"padded: {type(base).__name__} takes no registered attention implementation"
    if (getattr(config, "use_sliding_window", False) or "sliding_attention" in (getattr(config, "layer_types", None)
                                                                                or ())):
        return f"padded: {config.model_type}'s sliding-window attention"
    if getattr(config, "attn_logit_softcapping", None):
        return f"padded: {config.model_type}'s softcapped attention scores"
    return None


def use_varlen(model) -> None:
    """Route ``model``'s attention through :data:`VARLEN` (registered with transformers on first use)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, sdpa_mask

    if VARLEN not in ALL_MASK_ATTENTION_FUNCTIONS:
        AttentionInterface.register(VARLEN, varlen_attention)
        # No [tokens x tokens] mask for a packed pass (it has no 2D mask: attention is per row by its lengths)
        AttentionMaskInterface.register(
            VARLEN, lambda *args, attention_mask=None, **kwargs:
            None if attention_mask is None else sdpa_mask(*args, attention_mask=attention_mask, **kwargs))
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base.set_attn_implementation(VARLEN)


def varlen_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Transformers' attention call ([1, heads, tokens, head_dim] in, [1, tokens, heads, head_dim] out): per row of a
    packed pass (``cu_seq_lens_q`` given), else SDPA as the model would compute it."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    cumulative = kwargs.get("cu_seq_lens_q")
    if cumulative is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    if kwargs.get("sliding_window") is not None or kwargs.get("softcap") is not None or dropout:
        raise ValueError("a packed pass computes full causal attention without dropout (packing.choose)")
    # [tokens, heads, d], in autocast's precision as SDPA would take them (rotary embeddings leave q and k in float32)
    device = query.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else value.dtype
    q, k, v = (tensor.transpose(1, 2).squeeze(0).to(dtype, memory_format=torch.contiguous_format)
               for tensor in (query, key, value))
    if q.is_cuda:
        out = _varlen(q, k, v, cumulative, kwargs["max_length_q"], scaling)
    else:
        out = per_row_attention(q, k, v, cumulative, scaling)
    return out.unsqueeze(0), None


def _varlen(q, k, v, cumulative, longest: int, scaling):
    from torch.nn.attention.varlen import varlen_attn

    # The signature moves between torch versions: causal by a window (2.11) or by name, grouped key/value heads as
    # they are (2.11) or asked for by name, the scale given or the default 1 / sqrt(head_dim)
    parameters = _varlen_parameters()
    options = {"is_causal": True} if "is_causal" in parameters else {"window_size": (-1, 0)}
    if q.shape[1] != k.shape[1] and "enable_gqa" in parameters:
        options["enable_gqa"] = True
    if "scale" in parameters:
        options["scale"] = scaling
    elif scaling is not None and abs(scaling - q.shape[-1] ** -0.5) > 1e-6:
        raise ValueError(f"torch {torch.__version__}'s varlen attention takes no scale, the model's is {scaling}")
    return varlen_attn(q, k, v, cumulative, cumulative, longest, longest, **options)


@functools.cache
def _varlen_parameters() -> frozenset[str]:
    from torch.nn.attention.varlen import varlen_attn

    return frozenset(inspect.signature(varlen_attn).parameters)


def per_row_attention(q, k, v, cumulative, scaling):
    """What varlen attention computes, row by row with SDPA: the packed pass's path where varlen cannot run (a CPU,
    any precision), for tests to hold the packing to the padded passes."""
    bounds = cumulative.tolist()
    rows = []
    for start, end in itertools.pairwise(bounds):
        q_row, k_row, v_row = (tensor[start:end].transpose(0, 1) for tensor in (q, k, v))  # [heads, n, d]
        rows.append(torch.nn.functional.scaled_dot_product_attention(
            q_row, k_row, v_row, is_causal=True, scale=scaling, enable_gqa=q.shape[1] != k.shape[1]).transpose(0, 1))
    return torch.cat(rows)
