"""A real vLLM engine in a real Ray actor: sampling logprobs, and weight sync from the trainer without restart."""

from __future__ import annotations

from pathlib import Path

import pytest

from marl_pipeline.inference.engine import ENGINE_ENV, RolloutEngine
from marl_pipeline.training.batches import TrainBatch
from marl_pipeline.training.trainer import PolicyTrainer
from tests.sampling import requests

# Engine and trainer both run the model in float32; they differ only in kernels and summation order.
LOGPROB_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def engine(local_ray, tiny_model_dir: Path):
    actor = local_ray.remote(RolloutEngine).options(num_cpus=0.5, runtime_env={"env_vars": ENGINE_ENV})
    handle = actor.remote(str(tiny_model_dir), 0, gpu_memory_utilization=0.08, max_model_len=128, dtype="float32",
                          seed=0)
    yield handle
    local_ray.kill(handle)


@pytest.mark.launch
def test_rollout_logprobs_match_the_trainer(local_ray, engine, tiny_model_dir: Path) -> None:
    trainer = PolicyTrainer(str(tiny_model_dir), 0, lr=1e-3, weight_decay=0.0, max_grad_norm=1.0, clip_eps=0.2,
                            seed=0, num_threads=1)
    version, completions = local_ray.get(engine.generate.remote(requests(["1+2=", "3+3="], [1, 2], 6, 1.0)))
    assert version == 0 and len(completions) == 2
    for completion in completions:
        assert 1 <= len(completion.response_ids) <= 6 and len(completion.logprobs) == len(completion.response_ids)
        expected = trainer.completion_logprobs(completion.prompt_ids, completion.response_ids)
        assert completion.logprobs == pytest.approx(expected, abs=LOGPROB_TOLERANCE)


def test_same_seed_same_sample(local_ray, engine) -> None:
    first = local_ray.get(engine.generate.remote(requests(["2+2="] * 2, [5, 6], 6, 1.0)))[1]
    again = local_ray.get(engine.generate.remote(requests(["2+2="] * 2, [5, 6], 6, 1.0)))[1]
    assert [c.response_ids for c in first] == [c.response_ids for c in again]


def test_weight_sync_updates_the_running_engine(local_ray, engine, tiny_model_dir: Path) -> None:
    trainer = PolicyTrainer(str(tiny_model_dir), 0, lr=5e-2, weight_decay=0.0, max_grad_norm=1.0, clip_eps=0.2,
                            seed=0, num_threads=1)
    prompt, response = [17, 11, 18, 29], [20, 0]
    before = local_ray.get(engine.completion_logprobs.remote(prompt, response))
    assert before == pytest.approx(trainer.completion_logprobs(prompt, response), abs=LOGPROB_TOLERANCE)

    trainer.accumulate(TrainBatch([prompt], [response], [before], [1.0]))
    trainer.apply_step()
    weights = local_ray.put(trainer.named_weights())
    assert local_ray.get(engine.load_weights.remote(weights, trainer.version)) == 1

    after = local_ray.get(engine.completion_logprobs.remote(prompt, response))
    assert after == pytest.approx(trainer.completion_logprobs(prompt, response), abs=LOGPROB_TOLERANCE)
    assert max(abs(a - b) for a, b in zip(after, before)) > 1e-2  # the engine serves the new policy
    assert sum(after) > sum(before)  # and it is the update the advantage asked for
    assert local_ray.get(engine.policy_version.remote()) == 1


@pytest.mark.launch
def test_a_seeded_batch_past_vllms_default_token_budget_samples(local_ray, engine) -> None:
    # 120 prompts of ~60 tokens: 7,000+ prompt tokens, past vLLM's default 4,096 a step, where its CPU sampler used to
    # fail on seeded requests whose prompts were prefilled in chunks ("CPU Generator does not use offset").
    prompts = [" ".join(f"{(i + j) % 7}+{j % 4}=" for j in range(20)) for i in range(120)]
    _, completions = local_ray.get(engine.generate.remote(requests(prompts, list(range(120)), 4, 1.0)))
    assert sum(len(c.prompt_ids) for c in completions) > 4096
    assert all(c.response_ids for c in completions)
