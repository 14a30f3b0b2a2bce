"""A LoRA agent's weight sync on a real pretrained model: SmolLM2-135M in a float32 vLLM engine actor and a peft
trainer. The engine serves the base with the adapters merged in, by the same ``reload_weights`` path as a full
fine-tuning agent; an engine started later from the stored adapters (a resumed launch, an evaluation) serves the
same policy. One engine alive at a time."""

from __future__ import annotations

from pathlib import Path

from marl_pipeline.config import EngineConfig, LoraAdapterConfig
from marl_pipeline.runtime.trainer import PolicyTrainer, TrainBatch
from marl_pipeline.runtime.workers import engine_actor
from tests.test_model_sources import needs_smollm2

LOGPROB_TOLERANCE = 1e-4
"""Engine vs trainer, per token, in nats: float32 on both sides (tests/test_engine_sync.py). The engine's weights
are W + s B A computed once; the trainer computes x W + s (x A) B: the same function, rounded differently."""


def _distance(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def _engine(local_ray, model_dir: Path, version: int, adapter_dir: str | None = None):
    settings = EngineConfig(threads=2, max_model_len=128)
    return engine_actor(settings).remote(str(model_dir), version, gpu_memory_utilization=0.15,
                                         max_model_len=settings.max_model_len, dtype="float32", seed=0,
                                         threads=settings.threads, adapter_dir=adapter_dir)


@needs_smollm2
def test_a_lora_engine_serves_the_trainers_policy(local_ray, smollm2_dir: Path, tmp_path: Path) -> None:
    trainer = PolicyTrainer(str(smollm2_dir), 0, lr=1e-2, weight_decay=0.0, max_grad_norm=1.0, clip_eps=0.2, seed=0,
                            num_threads=2, lora=LoraAdapterConfig().model_dump(), base_dir=str(smollm2_dir))
    prompt = trainer.tokenizer.apply_chat_template([{"role": "user", "content": "What is 12 + 5?"}],
                                                   add_generation_prompt=True, tokenize=False)
    engine = _engine(local_ray, smollm2_dir, 0)
    try:
        version, (sample,) = local_ray.get(engine.generate.remote([prompt], [3], 6, 1.0))
        assert version == 0 and len(sample.response_ids) == 6
        # version 0 of a LoRA agent is its base (B = 0): the engine, which loaded the base alone, agrees
        assert _distance(sample.logprobs, trainer.completion_logprobs(sample.prompt_ids, sample.response_ids)) \
            <= LOGPROB_TOLERANCE
        before = local_ray.get(engine.completion_logprobs.remote(sample.prompt_ids, sample.response_ids))

        for advantage in (1.0, 1.0):
            trainer.accumulate(TrainBatch([sample.prompt_ids], [sample.response_ids], [sample.logprobs], [advantage]))
            trainer.apply_step()
        assert local_ray.get(engine.load_weights.remote(local_ray.put(trainer.named_weights()), 2)) == 2
        after = local_ray.get(engine.completion_logprobs.remote(sample.prompt_ids, sample.response_ids))
        expected = trainer.completion_logprobs(sample.prompt_ids, sample.response_ids)
        assert _distance(after, before) > 0.05  # the adapters moved the policy, and the engine serves the move
        assert _distance(after, expected) <= LOGPROB_TOLERANCE
    finally:
        local_ray.kill(engine)

    trainer.save(str(tmp_path / "version=2"))
    assert not (tmp_path / "version=2" / "model.safetensors").exists()  # adapters only
    restarted = _engine(local_ray, smollm2_dir, 2, adapter_dir=str(tmp_path / "version=2"))
    try:
        assert local_ray.get(restarted.policy_version.remote()) == 2
        served = local_ray.get(restarted.completion_logprobs.remote(sample.prompt_ids, sample.response_ids))
        assert _distance(served, expected) <= LOGPROB_TOLERANCE
        assert local_ray.get(restarted.model_directory.remote()) == str(smollm2_dir)  # the base: its tokenizer
    finally:
        local_ray.kill(restarted)
