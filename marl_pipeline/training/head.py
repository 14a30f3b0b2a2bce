"""The output head's token terms fused: each position's log-probability of its next token (and the vocabulary's
entropy there) from one pass over each chunk of the head's logits, forward and backward.

The unfused head (losses.py ``_chunk_terms``) turns each chunk's logits into float32, takes their log-softmax, and
reads that back for the gathered token and the entropy; its backward recomputes all of it and walks the same float32
tensors again. Here a chunk's forward keeps only three numbers a position (the log-normaliser, the token's logit,
the entropy) and the backward recomputes the logits and writes their gradient in one elementwise kernel
(torch.compile on CUDA, where it fuses into one; eager elsewhere, the same arithmetic), in the logits' own precision:

    d logp(t) / dz = onehot(t) - p        d H / dz = -p * (log p + H)

as Liger-Kernel's fused linear cross-entropy and TRL's fused log-probability head do. The head's matmuls are those
of the unfused head (one forward, one recomputed, two backward).
"""

from __future__ import annotations

import functools
import warnings

import torch


def fused_token_terms(features: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *, entropy: bool,
                      chunk: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probabilities of ``targets`` under ``features @ weight.T`` ([n] float32) and, asked, the entropies."""
    dtype = torch.get_autocast_dtype(features.device.type) if torch.is_autocast_enabled(features.device.type) \
        else weight.dtype
    logprobs, entropies = _FusedHead.apply(features, weight, targets, entropy, chunk, dtype)
    return logprobs, entropies if entropy else None


class _FusedHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, features, weight, targets, entropy: bool, chunk: int, dtype):
        head, inputs = weight.to(dtype), features.to(dtype)  # cast once, not a chunk at a time: fewer launches
        normalisers, picked, entropies = [], [], []
        for low in range(0, len(targets), chunk):
            logits = inputs[low : low + chunk] @ head.T
            normaliser, target_logit, spread = _kernels(features.device.type)[0](logits, targets[low : low + chunk])
            normalisers.append(normaliser)
            picked.append(target_logit)
            entropies.append(spread)
        empty = features.new_zeros(0, dtype=torch.float32)
        normaliser, target_logit, entropy_values = (torch.cat(parts) if parts else empty
                                                    for parts in (normalisers, picked, entropies))
        ctx.save_for_backward(inputs, weight, targets, normaliser, entropy_values)
        ctx.chunk, ctx.dtype, ctx.entropy, ctx.features_dtype = chunk, dtype, entropy, features.dtype
        return target_logit - normaliser, entropy_values

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        inputs, weight, targets, normaliser, entropy_values = ctx.saved_tensors
        head = weight.to(ctx.dtype)
        grad_logprobs = torch.zeros_like(normaliser) if grad_logprobs is None else grad_logprobs.float()
        grad_entropy = (torch.zeros_like(normaliser) if grad_entropy is None or not ctx.entropy
                        else grad_entropy.float())
        grad_features = []  # a chunk's each, cast and joined once (a copy a chunk was a kernel launch a chunk)
        grad_weight = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
        gradient = _kernels(inputs.device.type)[1]
        for low in range(0, len(targets), ctx.chunk):
            part = slice(low, low + ctx.chunk)
            logits = inputs[part] @ head.T
            grad_logits = gradient(logits, targets[part], normaliser[part], entropy_values[part],
                                   grad_logprobs[part], grad_entropy[part])
            if ctx.needs_input_grad[0]:
                grad_features.append(grad_logits @ head)
            if grad_weight is not None:
                grad_weight += grad_logits.T @ inputs[part]
        joined = torch.cat(grad_features).to(ctx.features_dtype) if grad_features else None
        if ctx.needs_input_grad[0] and joined is None:
            joined = inputs.new_zeros(inputs.shape, dtype=ctx.features_dtype)
        return joined, grad_weight, None, None, None, None


def _terms(logits: torch.Tensor, targets: torch.Tensor):
    """Per row: the log-normaliser, the target's logit and the entropy, float32."""
    values = logits.float()
    normaliser = values.logsumexp(-1)
    probabilities = (values - normaliser[:, None]).exp()
    return normaliser, values.gather(1, targets[:, None]).squeeze(1), normaliser - (probabilities * values).sum(-1)


def _gradient(logits, targets, normaliser, entropy, grad_logprobs, grad_entropy):
    """d loss / d logits, in the logits' precision."""
    values = logits.float()
    log_p = values - normaliser[:, None]
    p = log_p.exp()
    onehot = torch.zeros_like(values).scatter_(1, targets[:, None], 1.0)
    grad = grad_logprobs[:, None] * (onehot - p) - grad_entropy[:, None] * p * (log_p + entropy[:, None])
    return grad.to(logits.dtype)


@functools.cache
def _kernels(device_type: str):
    """The two elementwise functions, compiled on CUDA (one kernel each; Triton ships with torch there)."""
    if device_type == "cuda":
        return _compiled(_terms), _compiled(_gradient)
    return _terms, _gradient


def _compiled(function):
    """``function`` compiled at its first call, or as it is where compiling fails (warned, naming why): the same
    arithmetic, more memory traffic."""
    state = {"call": torch.compile(function, dynamic=True)}

    def call(*args):
        try:
            return state["call"](*args)
        except Exception as error:  # a machine without a C compiler for Triton's launcher, say
            if state["call"] is function:
                raise
            warnings.warn(f"the fused head runs uncompiled: torch.compile failed ({type(error).__name__}: {error})",
                          stacklevel=2)
            state["call"] = function
            return function(*args)

    return call
