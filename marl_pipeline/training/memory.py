"""What a trainer's peak device memory should be, from the model's config: the estimate docs/gpu.md documents and
tests/gpu checks against a GPU's measured peak."""

from __future__ import annotations

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
