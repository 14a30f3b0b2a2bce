"""What a trainer's peak device memory should be, from the model's config: the estimate docs/gpu.md documents and
tests/gpu checks against a GPU's measured peak; and moving a trainer's state off its GPU and back, for an engine
that shares the GPU (cluster/colocation.py)."""

from __future__ import annotations

import torch

from marl_pipeline.training.losses import LOGIT_CHUNK


def trainer_peak_bytes(config: dict, *, parameters: int, trainable: int, tokens: int, reference: bool = False,
                       activation_checkpointing: bool = True, chunk: int = LOGIT_CHUNK,
                       fused_head: bool = False, accumulated: bool = True) -> int:
    """Peak bytes of one trainer's pass and step over ``tokens`` tokens (one pass: ``chunk_tokens``): the largest of
    its high points, each one a GPU's measured peak showed (tests/gpu checks the estimate against them).
    ``accumulated``: the pass is not the step's first, so every gradient (4 bytes a trainable parameter) is already
    held from the passes before it; a step's only pass holds none (gradients are set to None after each step).

    - at rest: float32 weights (4 bytes a parameter) and, for the trainable ones, AdamW's two moments (8), fused on a
      GPU so the step makes no parameter-sized temporaries; a KL reference adds 4;
    - the output head's backward, first in the pass, while the pass's other gradients do not exist yet: the activations
      kept for the backward pass (with checkpointing each layer's float32 input, the residual stream; without it
      every layer's working set: bf16 projections, the MLP's three intermediate-sized tensors and their gradients),
      the head's gradient and bf16 copy, and three [chunk x vocabulary] float32 tensors (the logits, their
      log-softmax and its gradient: losses.LOGIT_CHUNK); the fused head (training/head.py) holds a chunk's bf16 logits
      and their bf16 gradient instead, and a bf16 product of the head's size before it adds it to the gradient;
    - with activation checkpointing, the decoder's backward as it starts: the head's high point less its logits, and
      the last layer's working set recomputed;
    - the end of the backward pass: every gradient (4 bytes a trainable parameter), the first layer's working set,
      and with tied embeddings the embedding's own gradient before it is added to the head's.
    """
    hidden, layers, vocabulary = config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]
    rest = 4 * parameters + 8 * trainable + (4 * parameters if reference else 0) + (4 * trainable if accumulated else 0)
    head = vocabulary * hidden
    head_gradient = 4 * head if trainable == parameters else 0  # a LoRA agent's head is frozen
    layer = tokens * (8 * hidden + 6 * config["intermediate_size"]) * 2
    kept = tokens * hidden * layers * 4 if activation_checkpointing else layer * layers
    logits = min(chunk, tokens) * vocabulary * (2 + 2 if fused_head else 3 * 4) + (2 * head if fused_head else 0)
    head_backward = rest + kept + head_gradient + 2 * head + logits
    decoder_backward = rest + kept + head_gradient + layer if activation_checkpointing else 0
    tied = head_gradient if config.get("tie_word_embeddings") else 0
    backward_end = rest + (0 if accumulated else 4 * trainable) + layer + tied
    return max(head_backward, decoder_backward, backward_end)


PASS_SHARE = 0.8
"""The share of a GPU's memory a trainer's pass budget plans for: the estimate can run under a measured peak, and
passes of unequal size leave part of the card in the allocator's fragments (docs/gpu.md)."""


def token_budget(config: dict, *, parameters: int, trainable: int, available: float, reference: bool = False,
                 activation_checkpointing: bool = True, fused_head: bool = False, limit: int = 1 << 22) -> int:
    """The most tokens a pass can hold with :func:`trainer_peak_bytes` within ``available`` bytes (at least 256, at
    most ``limit``): a GPU trainer's pass size when ``chunk_tokens`` is unset, planned for a pass after the step's
    first, so that it holds for every pass."""
    low, high = 256, limit
    while low < high:  # the estimate grows with the tokens
        middle = (low + high + 1) // 2
        peak = trainer_peak_bytes(config, parameters=parameters, trainable=trainable, tokens=middle,
                                  reference=reference, activation_checkpointing=activation_checkpointing,
                                  fused_head=fused_head)
        low, high = (middle, high) if peak <= available else (low, middle - 1)
    return low


def architecture(model: torch.nn.Module) -> dict:
    """What :func:`trainer_peak_bytes` reads of a Hugging Face model's config (a LoRA model's base's)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = base.config.get_text_config() if hasattr(base.config, "get_text_config") else base.config
    keys = ("hidden_size", "num_hidden_layers", "vocab_size", "intermediate_size", "tie_word_embeddings")
    missing = [key for key in keys[:4] if getattr(config, key, None) is None]
    if missing:
        raise ValueError(f"{type(base).__name__}'s config has no {', '.join(missing)}: set trainer.chunk_tokens")
    return {key: getattr(config, key, None) for key in keys}


def move_state(models: list[torch.nn.Module | None], optimizer: torch.optim.Optimizer, device: torch.device) -> int:
    """Move ``models``' parameters and gradients (the policy, its KL reference) and ``optimizer``'s state (AdamW's
    moments and step counts, on the GPU with the fused AdamW) to ``device`` in place; bytes moved. The parameters
    stay the same objects, so the optimizer's state stays keyed by them."""
    moved = 0
    for model in models:
        if model is not None:
            moved += sum(p.numel() * p.element_size() * (1 + (p.grad is not None)) for p in model.parameters())
            model.to(device)  # FSDP2 modules too: their sharded parameters move with their local shards
    for state in optimizer.state.values():
        for name, value in state.items():
            if torch.is_tensor(value) and value.device != device:
                state[name] = value.to(device)
                moved += value.numel() * value.element_size()
    if device.type == "cpu" and torch.cuda.is_available():
        torch.cuda.empty_cache()  # the freed blocks back to the GPU, for the engine's wake-up
    return moved
