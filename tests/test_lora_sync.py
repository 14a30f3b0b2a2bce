"""A LoRA agent's weight sync on a real pretrained model: SmolLM2-135M in a float32 vLLM engine actor and a peft
trainer. The engine serves the base with the adapters merged in, by the same ``reload_weights`` path as a full
fine-tuning agent; an engine started later from the stored adapters (a resumed launch, an evaluation) serves the
same policy. One engine alive at a time."""

from __future__ import annotations

from pathlib import Path

from marl_pipeline.cluster.spawn import engine_actor
from marl_pipeline.config import EngineConfig, LoraAdapterConfig
from marl_pipeline.inference.async_engine import AsyncRolloutEngine
from marl_pipeline.inference.engine import RolloutEngine
from marl_pipeline.policy.lora import TAUGHT, WARMUP_ADAPTER
from marl_pipeline.training.trainer import PolicyTrainer, TrainBatch
from tests.test_model_sources import needs_smollm2

LOGPROB_TOLERANCE = 1e-4
"""Engine vs trainer, per token, in nats: float32 on both sides (tests/test_engine_sync.py). The engine's weights
are W + s B A computed once; the trainer computes x W + s (x A) B: the same function, rounded differently."""


def _distance(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def _engine(local_ray, model_dir: Path, version: int, adapter_dir: str | None = None, actor_class=RolloutEngine):
    settings = EngineConfig(threads=2, max_model_len=128)
    return engine_actor(settings, actor_class=actor_class).remote(str(model_dir), version, gpu_memory_utilization=0.15,
                                         max_model_len=settings.max_model_len, dtype="float32", seed=0,
                                         threads=settings.threads, adapter_dir=adapter_dir)


def _version_0_with_warmup_adapters(smollm2_dir: Path, directory: Path) -> Path:
    """SmolLM2 as version 0 of an agent whose warm-up was kept apart: the model, and beside it rank-8 adapters
    whose B is random (a warm-up that moved the policy)."""
    import peft
    import torch

    from marl_pipeline.policy.checkpoint import load_policy

    directory.mkdir()
    for path in smollm2_dir.iterdir():
        (directory / path.name).symlink_to(path)
    model, _ = load_policy(str(smollm2_dir))
    warmed = peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear",
                                                        lora_dropout=0.0))
    torch.manual_seed(0)
    for name, param in warmed.named_parameters():
        if "lora_B" in name:
            param.data.normal_(0, 0.02)
    warmed.save_pretrained(str(directory / WARMUP_ADAPTER))
    return directory


@needs_smollm2
def test_a_lora_engine_serves_the_trainers_policy_and_separate_warm_up_adapters_on_their_turns(
        local_ray, smollm2_dir: Path, tmp_path: Path) -> None:
    """The engine serves RL's merged adapters on every request and, with ``warmup.separate``, the warm-up's adapters
    (vLLM's LoRA) on a taught turn's request only; the trainer computes each row the way its request was served,
    before and after RL steps, and never changes the warm-up's adapters. An engine started later from the stored
    adapters serves the same policy. One engine alive at a time (two engines cost a SmolLM2 start each)."""
    base = _version_0_with_warmup_adapters(smollm2_dir, tmp_path / "version=0")
    trainer = PolicyTrainer(str(base), 0, lr=1e-2, weight_decay=0.0, max_grad_norm=1.0, clip_eps=0.2, seed=0,
                            num_threads=2, lora=LoraAdapterConfig().model_dump(), base_dir=str(base))
    frozen = {name: param.detach().clone() for name, param in trainer.model.named_parameters() if f".{TAUGHT}." in name}
    assert frozen and trainer.has_taught
    prompt = trainer.tokenizer.apply_chat_template([{"role": "user", "content": "What is 12 + 5?"}],
                                                   add_generation_prompt=True, tokenize=False)
    engine = _engine(local_ray, base, 0, actor_class=AsyncRolloutEngine)

    def served(on, sample, taught: bool) -> list[float]:
        return local_ray.get(on.completion_logprobs.remote(sample.prompt_ids, sample.response_ids, taught))

    def trained(sample, taught: bool) -> list[float]:
        return trainer.completion_logprobs(sample.prompt_ids, sample.response_ids, taught=taught)

    try:
        # one batch mixing a taught turn's request and another's: each gets its own adapters
        version, (plain, taught) = local_ray.get(engine.generate.remote([prompt, prompt], [3, 3], 6, 1.0,
                                                                         [False, True]))
        assert version == 0 and len(plain.response_ids) == 6
        # version 0 of a LoRA agent is its base (B = 0): the engine, which loaded the base alone, agrees
        assert _distance(plain.logprobs, trained(plain, False)) <= LOGPROB_TOLERANCE
        assert _distance(taught.logprobs, trained(taught, True)) <= LOGPROB_TOLERANCE
        assert _distance(trained(taught, False), taught.logprobs) > 0.01  # the warm-up's adapters matter
        before = served(engine, plain, False)
        for _ in range(2):
            trainer.accumulate(TrainBatch([plain.prompt_ids, taught.prompt_ids],
                                          [plain.response_ids, taught.response_ids],
                                          [plain.logprobs, taught.logprobs], [1.0, 1.0], taught=[False, True]))
            trainer.apply_step()
        assert local_ray.get(engine.load_weights.remote(local_ray.put(trainer.named_weights()), 2)) == 2
        assert _distance(served(engine, plain, False), before) > 0.05  # RL's adapters moved the policy
        assert _distance(served(engine, plain, False), trained(plain, False)) <= LOGPROB_TOLERANCE
        assert _distance(served(engine, taught, True), trained(taught, True)) <= LOGPROB_TOLERANCE
    finally:
        local_ray.kill(engine)
    assert all(frozen[name].equal(param) for name, param in trainer.model.named_parameters() if name in frozen)

    trainer.save(str(tmp_path / "version=2"))
    assert not (tmp_path / "version=2" / "model.safetensors").exists()  # adapters only
    assert not (tmp_path / "version=2" / TAUGHT).exists()  # RL's; the warm-up's stay in version 0 alone
    restarted = _engine(local_ray, base, 2, adapter_dir=str(tmp_path / "version=2"), actor_class=AsyncRolloutEngine)
    try:
        assert local_ray.get(restarted.policy_version.remote()) == 2
        assert _distance(served(restarted, plain, False), trained(plain, False)) <= LOGPROB_TOLERANCE
        assert _distance(served(restarted, taught, True), trained(taught, True)) <= LOGPROB_TOLERANCE
        assert local_ray.get(restarted.model_directory.remote()) == str(base)  # the base: its tokenizer
    finally:
        local_ray.kill(restarted)
