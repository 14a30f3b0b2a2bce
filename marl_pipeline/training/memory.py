"""What a trainer's peak device memory should be, from the model's config: the estimate docs/gpu.md documents and
tests/gpu checks against a GPU's measured peak; and moving a trainer's state off its GPU and back, for an engine
that shares the GPU (cluster/colocation.py)."""

from __future__ import annotations

import torch

from marl_pipeline.training.losses import LOGIT_CHUNK


def trainer_peak_bytes(config: dict, *, parameters: int, trainable: int, tokens: int, reference: bool = False,
                       activation_checkpointing: bool = True, chunk: int = LOGIT_CHUNK) -> int:
    """Peak bytes of one trainer's pass and step over ``tokens`` tokens (one pass: ``chunk_tokens``).

    - state: float32 weights (4 bytes a parameter), and for the trainable ones their gradient (4) and AdamW's two
      moments (8), fused on a GPU so the step makes no parameter-sized temporaries; a KL reference adds 4;
    - the output head's chunks: four [chunk x vocabulary] float32 tensors (losses.LOGIT_CHUNK);
    - activations, with checkpointing: each layer's float32 input (the residual stream), kept for the backward
      pass, and one layer's working set while it is recomputed (bf16 projections, the MLP's three
      intermediate-sized tensors and their gradients); without it, that working set for every layer.
    """
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    state = 4 * parameters + 12 * trainable + (4 * parameters if reference else 0)
    logits = 4 * min(chunk, tokens) * config["vocab_size"] * 4
    layer = tokens * (8 * hidden + 6 * config["intermediate_size"]) * 2
    activations = tokens * hidden * layers * 4 + layer if activation_checkpointing else layer * layers
    return state + logits + activations


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
