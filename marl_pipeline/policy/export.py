"""A stored policy version as a plain Hugging Face directory (``marl export``): the trained model, loadable by
transformers and vLLM, without the trainer's state or the store's records."""

from __future__ import annotations

import shutil
from pathlib import Path

from marl_pipeline.policy.checkpoint import RECORD_FILES, load_policy, save_policy
from marl_pipeline.policy.lora import NAMED_ADAPTERS, is_adapter_checkpoint


def export_policy(version_dir: Path, base_dir: Path | None, out: Path, merge: bool = True) -> Path:
    """Write the policy in ``version_dir`` to ``out`` (new or empty). A LoRA version (adapters over ``base_dir``,
    the agent's version 0) is merged into a full model, or with ``merge=False`` written as its peft adapters."""
    require_empty(out)
    if is_adapter_checkpoint(version_dir) and merge:
        import peft

        if base_dir is None or not (base_dir / "config.json").is_file():
            raise FileNotFoundError(f"{version_dir} holds LoRA adapters; their base (version 0) is not at {base_dir}")
        model, tokenizer = load_policy(str(base_dir))
        merged = peft.PeftModel.from_pretrained(model, str(version_dir)).merge_and_unload()
        save_policy(merged, tokenizer, out)
        return out
    # Version 0's named adapters serve chosen turns inside a run (policy/lora.py): not part of the policy.
    shutil.copytree(version_dir, out, dirs_exist_ok=True, ignore=shutil.ignore_patterns(*RECORD_FILES, NAMED_ADAPTERS))
    return out


def require_empty(out: Path) -> None:
    """Raise ``FileExistsError`` naming ``out`` unless it is absent or an empty directory."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} is not empty: export into a new directory")
