"""LoRA through peft: an agent's trainable adapters over its frozen base policy (version 0), and the merged weights
engines serve.

Where each part lives. Version 0 of a LoRA agent is a full Hugging Face directory (the base, warmed up or not),
which ``store.retention`` never prunes; every later version holds only the adapters (peft's
``adapter_config.json`` and ``adapter_model.safetensors``) and the trainer state (AdamW's moments of the adapter
parameters, the RNG). An engine needs full weights, so it loads the base and merges a version's adapters on load
(:func:`merged_checkpoint`), and during a run it gets merged weights from the trainer (:func:`merged_weights`) by
the same ``reload_weights`` path as a fully fine-tuned agent. Why not vLLM's own LoRA (``enable_lora``), which
vLLM 0.32 does run on CPU: each version would have to reach the engine as a file before it could serve it, every
request would carry a ``LoRARequest``, and each token pays the adapters' extra matmuls;
merged weights cost nothing at serving time and keep one sync path for both kinds of agent.

Named adapters. Version 0 may also hold frozen adapters by name (``adapters/<name>/``; a warm-up with
``warmup.adapter`` writes one) that serve only the turns ``agents.<a>.turn_adapters`` gives them: an engine serves
each by vLLM's per-request LoRA over the merged RL weights, the row records its name, and the trainer computes
that row with the named adapter active beside the RL ones (:func:`use_adapter`).
"""

from __future__ import annotations

from pathlib import Path

ADAPTER_CONFIG = "adapter_config.json"
"""peft's file in a directory that holds adapters: how a LoRA checkpoint is told from a full one."""
NAMED_ADAPTERS = "adapters"
"""Version 0's subdirectory of named frozen adapters (``adapters/<name>/``, peft's format; ``warmup.adapter``)."""
_LEGACY_ADAPTERS = {"warmup_adapter": "warmup"}  # where runs before named adapters kept a separate warm-up's
POLICY = "default"
"""peft's name of the adapters RL trains (every version's)."""


class LoraCheckpointError(ValueError):
    """A policy directory does not hold what the agent's config needs (adapters or full weights)."""


def is_adapter_checkpoint(directory: str | Path) -> bool:
    return (Path(directory) / ADAPTER_CONFIG).is_file()


def lora_policy(model_dir: str, version: int, base_dir: str | None, *, rank: int, alpha: float,
                target_modules: str | list[str]):
    """(peft model with trainable adapters, tokenizer) for a LoRA agent at ``version``.

    Version 0 is the base itself (``model_dir``): fresh adapters are added to it, B = 0 so the policy starts
    equal to the base. A later version's ``model_dir`` holds adapters, loaded over ``base_dir`` (version 0)."""
    import peft

    from marl_pipeline.policy.checkpoint import load_policy

    if version == 0 and not is_adapter_checkpoint(model_dir):
        model, tokenizer = load_policy(model_dir)
        return with_adapters(model, rank=rank, alpha=alpha, target_modules=target_modules), tokenizer
    if not is_adapter_checkpoint(model_dir):
        raise LoraCheckpointError(
            f"{model_dir}: version {version} is a full fine-tuning checkpoint (no {ADAPTER_CONFIG}), but the agent "
            f"has `lora`: a LoRA agent's versions after 0 are adapters over version 0. Train it without `lora`, or "
            f"start a new run.")
    base = _require_base(base_dir, model_dir)
    saved = peft.PeftConfig.from_pretrained(model_dir)
    if (saved.r, float(saved.lora_alpha)) != (rank, float(alpha)):
        raise LoraCheckpointError(
            f"{model_dir}: adapters of rank {saved.r}, alpha {saved.lora_alpha}, but the agent's `lora` asks for rank "
            f"{rank}, alpha {alpha}; a lineage keeps its adapters' shape (start a new run to change it)")
    model, tokenizer = load_policy(base)
    return peft.PeftModel.from_pretrained(model, model_dir, is_trainable=True), tokenizer


def with_adapters(model, *, rank: int, alpha: float, target_modules: str | list[str]):
    """``model`` wrapped with fresh trainable adapters (B = 0: it computes what ``model`` did), the rest frozen."""
    import peft

    settings = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=target_modules, lora_dropout=0.0)
    return peft.get_peft_model(model, settings)


def named_adapter_dirs(base_dir: str | Path | None) -> dict[str, Path]:
    """The named frozen adapters of a version 0 directory, by name (none for a full version 0 without them)."""
    if base_dir is None:
        return {}
    base = Path(base_dir)
    found = {name: base / folder for folder, name in _LEGACY_ADAPTERS.items() if is_adapter_checkpoint(base / folder)}
    if (base / NAMED_ADAPTERS).is_dir():
        found |= {path.name: path for path in sorted((base / NAMED_ADAPTERS).iterdir()) if is_adapter_checkpoint(path)}
    return found


def add_named_adapters(model, adapter_dirs: dict[str, Path]) -> None:
    """Load named adapters into a peft model beside its RL adapters, frozen and inactive."""
    for name, directory in adapter_dirs.items():
        model.load_adapter(str(directory), adapter_name=name, is_trainable=False)
    model.base_model.set_adapter(POLICY)


def use_adapter(model, name: str | None) -> None:
    """Compute with the RL adapters alone (None), or with the named adapter added to them, as the engine serves a
    request that names it: its ``LoRARequest`` over the merged RL weights. The named one stays frozen either way."""
    model.base_model.set_adapter([POLICY, name] if name else POLICY)
    if name:  # peft makes every active adapter trainable
        for parameter_name, param in model.named_parameters():
            if f".{name}." in parameter_name:
                param.requires_grad_(False)


def merged_weights(model) -> list[tuple[str, object]]:
    """A peft model's weights as the plain model's (Hugging Face names), each adapted layer's weight W + s B A:
    what an engine loads. Computed beside the trainer's weights, which stay unmerged: merging in place and
    unmerging after would leave rounding in the frozen base every step."""
    import torch
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    with torch.no_grad():
        merged = {f"{name}.weight": module.base_layer.weight + module.get_delta_weight(POLICY)
                  for name, module in base.named_modules() if isinstance(module, LoraLayer)}
        weights = []
        for name, tensor in base.state_dict().items():
            if ".lora_" in name:
                continue
            plain = name.replace(".base_layer.", ".")
            weights.append((plain, merged[plain] if plain in merged else tensor.detach().clone()))
    return weights


def merged_checkpoint(base_dir: str, adapter_dir: str) -> list[tuple[str, object]]:
    """The merged weights of a stored adapter version over its base, for an engine that starts at that version."""
    import peft

    from marl_pipeline.policy.checkpoint import load_policy

    model, _ = load_policy(_require_base(base_dir, adapter_dir))
    return merged_weights(peft.PeftModel.from_pretrained(model, adapter_dir))


def _require_base(base_dir: str | None, adapter_dir: str) -> str:
    if base_dir is None or not (Path(base_dir) / "config.json").is_file():
        raise LoraCheckpointError(f"{adapter_dir} holds LoRA adapters, whose base policy (the agent's version 0) is "
                                  f"not at {base_dir}")
    return base_dir
