"""Engine requests for tests that sample a batch."""

from __future__ import annotations

from marl_pipeline.inference.engine import GenerationRequest


def requests(prompts: list, seeds: list[int], max_tokens: int, temperature: float) -> list[GenerationRequest]:
    """One request per prompt, each with its own seed."""
    return [GenerationRequest(prompt, seed, max_tokens, temperature)
            for prompt, seed in zip(prompts, seeds, strict=True)]
