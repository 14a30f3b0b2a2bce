"""The GPU suite: the trainer in-process on CUDA, on a machine with torch, transformers and peft but no Ray, vLLM or
Dagster, and nothing to download. Skipped without CUDA. Run it alone, so that the CPU suite's conftest (which
needs the whole project's packages) stays out: ``python -m pytest tests/gpu --confcutdir=tests/gpu``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    collect_ignore_glob = ["test_*.py"]  # no CUDA device: nothing here to run

ARCHITECTURES = {
    # SmolLM2-135M-Instruct's config.json (the packaged model's), and Llama-3.2-1B's: real shapes, random weights.
    "smollm2-135m": dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64, vocab_size=49152,
                         max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=True),
    "llama-1b": dict(model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
                     max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=True),
}


def build_model_dir(directory: Path, name: str) -> Path:
    """A Hugging Face directory of ``name``'s architecture with random weights (seed 0) and a small tokenizer."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from marl_pipeline.bootstrap.tiny_model import EOS_TOKEN, train_tokenizer

    if (directory / "config.json").is_file():
        return directory
    torch.manual_seed(0)
    settings = {key: value for key, value in ARCHITECTURES[name].items() if key != "model_type"}
    model = AutoModelForCausalLM.from_config(LlamaConfig(**settings, torch_dtype="float32"))
    tokenizer = train_tokenizer([f"{a} + {b} = {a + b}" for a in range(60) for b in range(60)])
    eos = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    model.config.eos_token_id = model.config.pad_token_id = eos
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    (directory / "architecture.json").write_text(json.dumps(ARCHITECTURES[name]))
    return directory


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gpu-models")
    return {name: build_model_dir(root / name, name) for name in ARCHITECTURES}
