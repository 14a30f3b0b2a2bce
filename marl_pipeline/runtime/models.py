"""Policy models: the built-in tiny causal LM, and loading any Hugging Face model directory or hub id.

The built-in model is a Qwen2-architecture transformer built from a config (head_dim 64, which vLLM's
CPU attention supports) with a byte-level BPE tokenizer trained on the environment's own text, saved
in Hugging Face format so that vLLM and transformers load it through the same code path as any other
model. Nothing is downloaded.
"""

from __future__ import annotations

from pathlib import Path

EOS_TOKEN = "<|endoftext|>"
TINY_ARCHITECTURE = {
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 512,
}


def train_tokenizer(corpus: list[str], vocab_size: int = 384):
    """Train a byte-level BPE tokenizer on ``corpus``; returns a transformers fast tokenizer."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(corpus, vocab_size=vocab_size, min_frequency=2, special_tokens=[EOS_TOKEN])
    return PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN)


def build_tiny_model(directory: Path, corpus: list[str], seed: int) -> Path:
    """Build and save the built-in tiny model and its tokenizer into ``directory``."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    tokenizer = train_tokenizer(corpus)
    eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
        **TINY_ARCHITECTURE,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    save_policy(model, tokenizer, directory)
    GenerationConfig(eos_token_id=eos_id, pad_token_id=eos_id).save_pretrained(directory)
    return directory


def load_policy(model: str):
    """Load (model, tokenizer) in float32 from a local Hugging Face directory or a hub id."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if (Path(model) / "adapter_config.json").is_file() and not (Path(model) / "config.json").is_file():
        # A LoRA version (runtime/lora.py): transformers would fail on the missing config.json with no word of why.
        raise ValueError(f"{model} holds LoRA adapters, not a full model: load it over its base policy (the agent's "
                         f"version 0) with the agent's `lora` config")

    policy = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model)
    return policy, tokenizer


def save_policy(model, tokenizer, directory: Path) -> None:
    """Save a policy in Hugging Face format (safetensors), readable by vLLM and transformers."""
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)


def kv_cache_bytes_per_token(model_dir: str | Path, dtype_bytes: int = 4) -> int:
    """Bytes of KV cache one token takes in ``model_dir``'s model (keys and values of every layer), from its
    config.json: what sizes an engine's ``kv_cache_gib`` in tokens."""
    import json

    config = json.loads((Path(model_dir) / "config.json").read_text())
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    return 2 * config["num_hidden_layers"] * config.get("num_key_value_heads", heads) * head_dim * dtype_bytes
