"""A policy on disk: loading any Hugging Face model directory or hub id in float32, saving one in safetensors, and
what its config says about serving it (KV cache bytes per token)."""

from __future__ import annotations

from pathlib import Path

TRAINER_STATE = "trainer_state.pt"
"""Saved beside a policy version's weights: what a resumed launch needs to continue exactly (AdamW's moments and
step counts, torch's RNG state, the version it belongs to). The learning-rate schedule is a function of the
version, so the version restores it."""
RECORD_FILES = (TRAINER_STATE, "timing.json")
"""A stored version's files that are not the model: the trainer's state and the publisher's timing record."""


def load_policy(model: str):
    """Load (model, tokenizer) in float32 from a local Hugging Face directory or a hub id."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if (Path(model) / "adapter_config.json").is_file() and not (Path(model) / "config.json").is_file():
        # A LoRA version (policy/lora.py): transformers would fail on the missing config.json with no word of why.
        raise ValueError(f"{model} holds LoRA adapters, not a full model: load it over its base policy (the agent's "
                         f"version 0) with the agent's `lora` config")

    policy = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model)
    return policy, tokenizer


def save_policy(model, tokenizer, directory: Path, state_dict: dict | None = None) -> None:
    """Save a policy in Hugging Face format (safetensors), readable by vLLM and transformers; ``state_dict``: weights
    to save in place of the model's own (a sharded trainer's, gathered)."""
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True, state_dict=state_dict)
    tokenizer.save_pretrained(directory)


def kv_cache_bytes_per_token(model_dir: str | Path, dtype_bytes: int = 4) -> int:
    """Bytes of KV cache one token takes in ``model_dir``'s model (keys and values of every layer), from its
    config.json: what sizes an engine's ``kv_cache_gib`` in tokens."""
    import json

    config = json.loads((Path(model_dir) / "config.json").read_text())
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    return 2 * config["num_hidden_layers"] * config.get("num_key_value_heads", heads) * head_dim * dtype_bytes
