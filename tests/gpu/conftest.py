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
    # Qwen2.5-3B's config.json: biases on the query, key and value projections, 2 key/value heads of 16.
    "qwen2.5-3b": dict(model_type="qwen2", hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                       num_attention_heads=16, num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768,
                       rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True, use_sliding_window=False),
}
TESTED = ("smollm2-135m", "llama-1b")
"""The architectures the suite builds (bench/engines/gpu_trainer.py builds any of them)."""


def build_model_dir(directory: Path, name: str) -> Path:
    """A Hugging Face directory of ``name``'s architecture with random weights (seed 0) and a small tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from marl_pipeline.bootstrap.tiny_model import EOS_TOKEN, train_tokenizer

    if (directory / "config.json").is_file():
        return directory
    torch.manual_seed(0)
    settings = dict(ARCHITECTURES[name])
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(settings.pop("model_type"), **settings))
    tokenizer = train_tokenizer([f"{a} + {b} = {a + b}" for a in range(60) for b in range(60)])
    eos = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    model.config.eos_token_id = model.config.pad_token_id = eos
    model.to(torch.bfloat16).save_pretrained(directory)  # half the bytes to write and read; trainers load float32
    tokenizer.save_pretrained(directory)
    (directory / "architecture.json").write_text(json.dumps(ARCHITECTURES[name]))
    return directory


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gpu-models")
    return {name: build_model_dir(root / name, name) for name in TESTED}
