"""A LoRA agent's weight sync on a real pretrained model: SmolLM2-135M in a float32 vLLM engine actor and a peft
trainer. The engine serves the base with the adapters merged in, by the same ``reload_weights`` path as a full
fine-tuning agent (the merged weights broadcast from the trainer, bit for bit what the object store carries); an
engine started again from the stored adapters (a resumed launch, an evaluation) serves the same policy. One engine
alive at a time."""

from __future__ import annotations

from pathlib import Path

import pytest

from marl_pipeline.cluster.spawn import engine_actor
from marl_pipeline.config import EngineConfig, LoraAdapterConfig
from marl_pipeline.inference.async_engine import AsyncRolloutEngine
from marl_pipeline.inference.engine import GenerationRequest, RolloutEngine
from marl_pipeline.inference.replicas import EngineReplicas
from marl_pipeline.policy.lora import NAMED_ADAPTERS
from marl_pipeline.training.batches import TrainBatch
from marl_pipeline.training.trainer import PolicyTrainer
from tests.test_model_sources import needs_smollm2
from tests.test_replicas import broadcast_from

pytestmark = pytest.mark.launch

LOGPROB_TOLERANCE = 1e-4
"""Engine vs trainer, per token, in nats: float32 on both sides (tests/test_engine_sync.py). The engine's weights
are W + s B A computed once; the trainer computes x W + s (x A) B: the same function, rounded differently."""


def _distance(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


ENGINE = {"gpu_memory_utilization": 0.15, "max_model_len": 128, "dtype": "float32", "seed": 0, "threads": 2}


def _engine(local_ray, model_dir: Path, version: int, adapter_dir: str | None = None, actor_class=RolloutEngine):
    settings = EngineConfig(threads=ENGINE["threads"], max_model_len=ENGINE["max_model_len"])
    return engine_actor(settings, actor_class=actor_class).remote(str(model_dir), version, adapter_dir=adapter_dir,
                                                                  **ENGINE)


ADAPTER = "verdict"


def _version_0_with_named_adapters(smollm2_dir: Path, directory: Path) -> Path:
    """SmolLM2 as version 0 of an agent whose warm-up was kept apart: the model, and beside it rank-8 adapters
    named ``verdict`` whose B is random (a warm-up that moved the policy)."""
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
    warmed.save_pretrained(str(directory / NAMED_ADAPTERS / ADAPTER))
    return directory


@needs_smollm2
def test_a_lora_engine_serves_the_trainers_policy_and_a_named_adapter_on_the_requests_that_name_it(
        local_ray, smollm2_dir: Path, tmp_path: Path) -> None:
    """The engine serves RL's merged adapters on every request and version 0's named adapter (vLLM's LoRA) on the
    requests that name it only; the trainer computes each row with the adapter its row names, before and after RL
    steps, and never changes the named adapter. An unknown name is refused by both. The engine started again from
    the stored adapters serves the same policy. One engine actor (a second cost a SmolLM2 start and vLLM's
    imports)."""
    base = _version_0_with_named_adapters(smollm2_dir, tmp_path / "version=0")
    trainer = PolicyTrainer(str(base), 0, lr=1e-2, weight_decay=0.0, max_grad_norm=1.0, clip_eps=0.2, seed=0,
                            num_threads=2, lora=LoraAdapterConfig().model_dump(), base_dir=str(base))
    frozen = {name: param.detach().clone() for name, param in trainer.model.named_parameters()
              if f".{ADAPTER}." in name}
    assert frozen and trainer.named_adapters == {ADAPTER}
    prompt = trainer.tokenizer.apply_chat_template([{"role": "user", "content": "What is 12 + 5?"}],
                                                   add_generation_prompt=True, tokenize=False)
    engine = _engine(local_ray, base, 0, actor_class=AsyncRolloutEngine)

    def served(on, sample, adapter: str | None) -> list[float]:
        return local_ray.get(on.completion_logprobs.remote(sample.prompt_ids, sample.response_ids, adapter))

    def trained(sample, adapter: str | None) -> list[float]:
        return trainer.completion_logprobs(sample.prompt_ids, sample.response_ids, adapter=adapter)

    try:
        # one batch mixing a request that names the adapter and one that does not: each gets its own
        version, (plain, adapted) = local_ray.get(engine.generate.remote(
            [GenerationRequest(prompt, 3, 6, 1.0), GenerationRequest(prompt, 3, 6, 1.0, adapter=ADAPTER)]))
        assert version == 0 and len(plain.response_ids) == 6
        # version 0 of a LoRA agent is its base (B = 0): the engine, which loaded the base alone, agrees
        assert _distance(plain.logprobs, trained(plain, None)) <= LOGPROB_TOLERANCE
        assert _distance(adapted.logprobs, trained(adapted, ADAPTER)) <= LOGPROB_TOLERANCE
        assert _distance(trained(adapted, None), adapted.logprobs) > 0.01  # the named adapter matters
        with pytest.raises(ValueError, match=r"adapter 'working'.*\['verdict'\]"):
            local_ray.get(engine.generate.remote([GenerationRequest(prompt, 3, 6, 1.0, adapter="working")]))
        with pytest.raises(ValueError, match=r"adapter 'working'.*\['verdict'\]"):
            trainer.completion_logprobs(plain.prompt_ids, plain.response_ids, adapter="working")
        before = served(engine, plain, None)
        for _ in range(2):
            trainer.accumulate(TrainBatch([plain.prompt_ids, adapted.prompt_ids],
                                          [plain.response_ids, adapted.response_ids],
                                          [plain.logprobs, adapted.logprobs], [1.0, 1.0], adapters=[None, ADAPTER]))
            trainer.apply_step()
        broadcast_from(EngineReplicas("lora", [engine], version=0), trainer)  # the merged weights, by broadcast
        assert local_ray.get(engine.policy_version.remote()) == 2
        by_broadcast = served(engine, plain, None)
        assert local_ray.get(engine.load_weights.remote(local_ray.put(trainer.named_weights()), 2)) == 2
        assert served(engine, plain, None) == by_broadcast  # the same bits through the object store
        assert _distance(served(engine, plain, None), before) > 0.05  # RL's adapters moved the policy
        assert _distance(served(engine, plain, None), trained(plain, None)) <= LOGPROB_TOLERANCE
        assert _distance(served(engine, adapted, ADAPTER), trained(adapted, ADAPTER)) <= LOGPROB_TOLERANCE
        assert all(frozen[name].equal(param) for name, param in trainer.model.named_parameters() if name in frozen)

        trainer.save(str(tmp_path / "version=2"))
        assert not (tmp_path / "version=2" / "model.safetensors").exists()  # adapters only
        assert not (tmp_path / "version=2" / NAMED_ADAPTERS).exists()  # RL's; the named ones stay in version 0 alone
        # Started again from the stored adapters, as a resumed launch's engine starts: built anew from the files
        # (in this process, as a kept engine is rebuilt, which a new actor's vLLM imports would only slow).
        assert local_ray.get(engine.restart.remote(str(base), 2, adapter_dir=str(tmp_path / "version=2"), **ENGINE))
        assert local_ray.get(engine.policy_version.remote()) == 2
        assert _distance(served(engine, plain, None), trained(plain, None)) <= LOGPROB_TOLERANCE
        assert _distance(served(engine, adapted, ADAPTER), trained(adapted, ADAPTER)) <= LOGPROB_TOLERANCE
        assert local_ray.get(engine.model_directory.remote()) == str(base)  # the base: its tokenizer
    finally:
        local_ray.kill(engine)
