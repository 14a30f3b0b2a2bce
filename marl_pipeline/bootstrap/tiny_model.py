"""The built-in tiny causal LM: a Qwen2-architecture transformer built from a config (head_dim 64, which vLLM's
CPU attention supports) with a byte-level BPE tokenizer trained on the environment's own text, saved in Hugging
Face format so that vLLM and transformers load it through the same code path as any other model. Nothing is
downloaded.
"""

from __future__ import annotations

from pathlib import Path

from marl_pipeline.policy.checkpoint import save_policy

BUILTIN_MODEL = "builtin"
"""The built-in model's name among the run's models in the store (``run=R/models/name=builtin``)."""
EOS_TOKEN = "<|endoftext|>"
TINY_ARCHITECTURE = {
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 1024,
}


def train_tokenizer(corpus: list[str], vocab_size: int = 384):
    """Train a byte-level BPE tokenizer on ``corpus``; returns a transformers fast tokenizer."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(corpus, vocab_size=vocab_size, min_frequency=2, special_tokens=[EOS_TOKEN])
    return PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN)


def build_tiny_model(directory: Path, corpus: list[str], seed: int, tokenizer=None) -> Path:
    """Build and save the built-in tiny model and its tokenizer (``tokenizer``, else one trained on ``corpus``) into
    ``directory``."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    tokenizer = tokenizer or train_tokenizer(corpus)
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
