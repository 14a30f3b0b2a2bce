"""The asynchronous engine actor on a real vLLM engine in a real async Ray actor: per-request sampling, aborts,
and a weight reload that waits for the requests in flight."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from marl_pipeline.cluster.spawn import engine_actor
from marl_pipeline.config import EngineConfig
from marl_pipeline.inference.async_engine import AsyncRolloutEngine, RequestAborted
from marl_pipeline.inference.engine import MAX_NUM_SEQS, GenerationRequest, PromptTooLong
from marl_pipeline.policy.checkpoint import kv_cache_bytes_per_token
from marl_pipeline.training.batches import TrainBatch
from marl_pipeline.training.trainer import PolicyTrainer
from tests.sampling import requests

LOGPROB_TOLERANCE = 1e-4
PROMPT = [17, 11, 18, 29]


@pytest.fixture(scope="module")
def engine(local_ray, tiny_model_dir: Path):
    handle = engine_actor(EngineConfig(), actor_class=AsyncRolloutEngine).remote(
        # Two threads: the engine thread must compute with the count the engine was built with (one is the default).
        str(tiny_model_dir), 0, gpu_memory_utilization=0.15, max_model_len=128, dtype="float32", seed=0, threads=2)
    local_ray.get(handle.policy_version.remote())
    yield handle
    local_ray.kill(handle)


@pytest.mark.launch
def test_a_request_samples_the_same_alone_or_among_others(local_ray, engine, tiny_model_dir: Path) -> None:
    alone = local_ray.get(engine.generate_one.remote("alone", GenerationRequest(PROMPT, 7, 12, 1.0)))
    crowd = [engine.generate_one.remote(f"crowd-{i}", GenerationRequest([17, 11, 18 + i % 3, 29], 100 + i, 12, 1.0))
             for i in range(16)]
    among = local_ray.get(engine.generate_one.remote("among", GenerationRequest(PROMPT, 7, 12, 1.0)))
    local_ray.get(crowd)
    assert alone.version == among.version == 0
    assert alone.completion.response_ids == among.completion.response_ids
    assert alone.completion.prompt_ids == PROMPT
    trainer = PolicyTrainer(str(tiny_model_dir), 0, lr=1e-3, weight_decay=0.0, max_grad_norm=1.0, clip_eps=0.2,
                            seed=0, num_threads=1)
    expected = trainer.completion_logprobs(PROMPT, among.completion.response_ids)
    assert among.completion.logprobs == pytest.approx(expected, abs=LOGPROB_TOLERANCE)


def test_the_batched_call_keeps_the_batch_engines_contract(local_ray, engine) -> None:
    version, completions = local_ray.get(engine.generate.remote(requests(["1+2=", PROMPT], [1, 7], 12, 1.0)))
    assert version == 0 and len(completions) == 2
    single = local_ray.get(engine.generate_one.remote("again", GenerationRequest(PROMPT, 7, 12, 1.0)))
    assert completions[1].response_ids == single.completion.response_ids
    with pytest.raises(Exception, match="prompt 1: expected a str or a non-empty list of int token ids"):
        local_ray.get(engine.generate.remote(requests(["1+2=", []], [1, 2], 4, 1.0)))


def test_the_engine_counts_its_steps_and_the_sequences_each_held(local_ray, engine) -> None:
    steps, sequences = local_ray.get(engine.step_counts.remote())
    alone = local_ray.get(engine.generate_one.remote("counted", GenerationRequest(PROMPT, 7, 6, 1.0)))
    length = len(alone.completion.response_ids)
    after = local_ray.get(engine.step_counts.remote())
    assert after == (steps + length, sequences + length)  # a token a step, the prompt's with the first
    _, together = local_ray.get(engine.generate.remote(requests([PROMPT, "1+2="], [7, 3], 6, 1.0)))
    lengths = [len(completion.response_ids) for completion in together]
    # taken in one step: they share steps while both run
    assert local_ray.get(engine.step_counts.remote()) == (after[0] + max(lengths), after[1] + sum(lengths))


def test_a_streamed_batch_yields_each_request_once_as_sampled_alone_and_a_bad_one_fails_alone(local_ray,
                                                                                              engine) -> None:
    batch = [(f"stream-{i}", GenerationRequest(PROMPT, i, 4 + 3 * i, 1.0, ignore_eos=True)) for i in range(6)]
    batch.append(("bad", GenerationRequest(PROMPT, 0, 4, 1.0, adapter="nowhere")))
    # Prompts that leave no room for an output token in the fixture's 128: vLLM refuses each its own way.
    too_long = {f"context-{length}": GenerationRequest(PROMPT * (length // 4), 0, 4, 1.0) for length in (128, 132)}
    batch.extend(too_long.items())
    chunks = [local_ray.get(ref) for ref in engine.generate_stream.options(num_returns="streaming").remote(batch)]
    results = dict(item for chunk in chunks for item in chunk)
    assert sorted(results) == sorted(request_id for request_id, _ in batch)  # each once
    assert sum(len(chunk) for chunk in chunks) == len(batch)
    assert len(chunks) > 1  # streamed as they finish: 4 to 19 tokens end in different engine steps
    assert isinstance(results["bad"], ValueError) and "nowhere" in str(results["bad"])
    for request_id in too_long:
        assert isinstance(results[request_id], PromptTooLong) and "128" in str(results[request_id]), results[request_id]
    for request_id, request in batch[:-3]:
        alone = local_ray.get(engine.generate_one.remote(f"{request_id}-alone", request))
        assert results[request_id].completion.response_ids == alone.completion.response_ids


class _EagerSwitching(AsyncRolloutEngine):
    """The engine actor unchanged, with the interpreter handing its lock between threads every microsecond: what a
    crowded node does to the engine thread and the actor's event loop (the OS preempting one for the other)."""

    def switch_every(self, seconds: float) -> None:
        sys.setswitchinterval(seconds)


@pytest.mark.launch
def test_a_step_s_results_stream_in_one_chunk_while_the_loop_thread_interleaves(local_ray,
                                                                                tiny_model_dir: Path) -> None:
    handle = engine_actor(EngineConfig(), actor_class=_EagerSwitching).remote(
        str(tiny_model_dir), 0, gpu_memory_utilization=0.15, max_model_len=128, dtype="float32", seed=0)
    try:
        local_ray.get(handle.switch_every.remote(1e-6))
        batch = [(f"same-{i}", GenerationRequest(PROMPT, i, 6, 1.0, ignore_eos=True)) for i in range(64)]
        for _ in range(3):  # each time: all 64 end in the same engine step
            chunks = [local_ray.get(ref) for ref in
                      handle.generate_stream.options(num_returns="streaming").remote(batch)]
            assert [len(chunk) for chunk in chunks] == [64]
    finally:
        local_ray.kill(handle)


def test_an_aborted_or_cancelled_request_leaves_the_engine_and_the_others_finish(local_ray, engine) -> None:
    others = [engine.generate_one.remote(f"other-{i}", GenerationRequest(PROMPT, i, 100, 1.0)) for i in range(4)]
    doomed = engine.generate_one.remote("doomed", GenerationRequest(PROMPT, 99, 100, 1.0))
    cancelled = engine.generate_one.remote("cancelled", GenerationRequest(PROMPT, 98, 100, 1.0))
    time.sleep(0.05)
    local_ray.get(engine.abort.remote(["doomed", "never-sent"]))
    local_ray.cancel(cancelled)
    with pytest.raises(Exception) as aborted:
        local_ray.get(doomed)
    assert isinstance(aborted.value.cause, RequestAborted) if hasattr(aborted.value, "cause") else True
    assert "aborted" in str(aborted.value)
    with pytest.raises(local_ray.exceptions.TaskCancelledError):
        local_ray.get(cancelled)
    assert all(s.completion.response_ids for s in local_ray.get(others))
    assert local_ray.get(engine.unfinished_requests.remote()) == 0


def test_a_weight_reload_waits_for_requests_in_flight_and_later_ones_use_the_new_version(
        local_ray, engine, tiny_model_dir: Path) -> None:
    def trainer() -> PolicyTrainer:
        return PolicyTrainer(str(tiny_model_dir), 0, lr=5e-2, weight_decay=0.0, max_grad_norm=1.0, clip_eps=0.2,
                             seed=0, num_threads=1)

    old, new = trainer(), trainer()
    before = local_ray.get(engine.completion_logprobs.remote(PROMPT, [20, 0]))
    new.accumulate(TrainBatch([PROMPT], [[20, 0]], [before], [1.0]))
    new.apply_step()
    weights = local_ray.put(new.named_weights())

    in_flight = [engine.generate_one.remote(f"old-{i}", GenerationRequest(PROMPT, i, 60, 1.0)) for i in range(4)]
    time.sleep(0.05)
    assert local_ray.get(engine.load_weights.remote(weights, 1)) == 1
    # Sampled wholly by the old weights: the reload waited for them instead of landing mid-generation.
    for sampled in local_ray.get(in_flight):
        assert sampled.version == 0
        response = sampled.completion.response_ids
        assert sampled.completion.logprobs == pytest.approx(old.completion_logprobs(PROMPT, response),
                                                            abs=LOGPROB_TOLERANCE)
    later = local_ray.get(engine.generate_one.remote("new", GenerationRequest(PROMPT, 1, 8, 1.0)))
    assert later.version == 1
    assert later.completion.logprobs == pytest.approx(new.completion_logprobs(PROMPT, later.completion.response_ids),
                                                      abs=LOGPROB_TOLERANCE)
    assert local_ray.get(engine.policy_version.remote()) == 1


def test_an_engine_on_a_cpu_holds_every_sequence_twice_where_its_memory_share_gives_more(local_ray, engine) -> None:
    """Without ``kv_cache_gib``, a CPU engine's cache is room for all its sequences at full length twice over (the
    second for prefixes), not the share's 3 GiB: vLLM zeroes the whole cache as the engine starts."""
    wanted = 2 * MAX_NUM_SEQS * 128  # the fixture's max_model_len
    assert wanted - 128 < local_ray.get(engine.kv_cache_tokens.remote()) <= wanted


@pytest.mark.launch
def test_an_engine_given_a_kv_cache_size_holds_that_many_tokens(local_ray, tiny_model_dir: Path) -> None:
    """``engine.kv_cache_gib`` sizes the cache itself (vLLM's kv_cache_memory_bytes), whatever the memory share."""
    token_bytes = kv_cache_bytes_per_token(tiny_model_dir)
    handle = engine_actor(EngineConfig(), actor_class=AsyncRolloutEngine).remote(
        str(tiny_model_dir), 0, gpu_memory_utilization=0.15, max_model_len=128, dtype="float32", seed=0, threads=1,
        kv_cache_gib=0.01)
    try:
        tokens = local_ray.get(handle.kv_cache_tokens.remote())
    finally:
        local_ray.kill(handle)
    wanted = 0.01 * 2**30 / token_bytes
    assert wanted - 128 < tokens <= wanted  # whole 128-token blocks of the CPU backend


@pytest.mark.launch
def test_a_sleeping_engine_refuses_requests_until_the_next_version_wakes_it(local_ray, engine,
                                                                            tiny_model_dir: Path) -> None:
    """The engine side of an agent whose engine and trainer take turns on its GPUs (cluster/colocation.py); on a CPU
    vLLM's sleep pauses its scheduler alone (level 0)."""
    running = engine.generate_one.remote("long", GenerationRequest(PROMPT, 3, 120, 1.0, ignore_eos=True))
    while local_ray.get(engine.unfinished_requests.remote()) == 0:
        time.sleep(0.001)
    with pytest.raises(Exception, match="cannot sleep with 1 requests running"):
        local_ray.get(engine.sleep.remote())
    local_ray.get(running)
    local_ray.get(engine.sleep.remote())
    local_ray.get(engine.sleep.remote())  # asleep already: nothing more
    with pytest.raises(Exception, match="the engine is asleep, its GPUs lent to its agent's trainer"):
        local_ray.get(engine.generate_one.remote("asleep", GenerationRequest(PROMPT, 1, 4, 1.0)))
    version = local_ray.get(engine.policy_version.remote())
    trainer = PolicyTrainer(str(tiny_model_dir), 0, lr=1e-3, weight_decay=0.0, max_grad_norm=1.0, clip_eps=0.2,
                            seed=0, num_threads=1)
    assert trainer.offload() == trainer.onload() == 0  # on a CPU the trainer has no GPU memory to give back
    local_ray.get(engine.load_weights.remote(local_ray.put(trainer.named_weights()), version + 1))
    woken = local_ray.get(engine.generate_one.remote("woken", GenerationRequest(PROMPT, 1, 4, 1.0)))
    assert woken.version == version + 1
    ((slept, woke),) = local_ray.get(engine.handovers.remote())
    assert slept < woke
