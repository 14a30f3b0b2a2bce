"""The trainer on CUDA: a bf16 step matches the CPU's float32 step, its token throughput is at least 0.9 of a bare
torch loop's on the same GPU, and its peak memory is within 10% of the documented estimate (training/memory.py)."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import torch

from marl_pipeline.training.batches import TrainBatch
from marl_pipeline.training.losses import pad_sequences
from marl_pipeline.training.memory import trainer_peak_bytes
from marl_pipeline.training.trainer import PolicyTrainer

ROWS, PROMPT, RESPONSE = 16, 96, 64


def _batch(seed: int = 0, rows: int = ROWS) -> TrainBatch:
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(1, 300, size=PROMPT).tolist() for _ in range(rows)]
    responses = [rng.integers(1, 300, size=RESPONSE).tolist() for _ in range(rows)]
    old = [[-5.0] * RESPONSE for _ in range(rows)]
    return TrainBatch(prompts, responses, old, rng.normal(size=rows).tolist())


def _trainer(model_dir, device: str, dtype: str, **options) -> PolicyTrainer:
    return PolicyTrainer(str(model_dir), 0, lr=1e-5, weight_decay=0.0, max_grad_norm=1.0, clip_eps=0.2, seed=0,
                         dtype=dtype, device=device, chunk_tokens=1 << 20, **options)


def test_a_bf16_step_on_cuda_matches_the_cpu_float32_step(model_dirs) -> None:
    """Tolerances: the response tokens' log-probabilities within 0.02 nats on average, and the gradient's direction
    (cosine over every parameter) at least 0.99."""
    batch = _batch(rows=4)
    grads, logprobs = {}, {}
    for device, dtype in (("cpu", "float32"), ("cuda", "bfloat16")):
        trainer = _trainer(model_dirs["smollm2-135m"], device, dtype)
        logprobs[device] = torch.tensor([trainer.completion_logprobs(p, r) for p, r in
                                         zip(batch.prompt_ids, batch.response_ids)])
        if device == "cpu":  # sampled by the float32 policy, with advantages of both signs: every token has a gradient
            batch = TrainBatch(batch.prompt_ids, batch.response_ids, logprobs["cpu"].tolist(), [1.0, -1.0, 0.5, -0.5])
        trainer.accumulate(batch)
        grads[device] = torch.cat([param.grad.float().cpu().flatten() for param in trainer.model.parameters()])
        result = trainer.apply_step()
        assert result.policy_version == 1 and all(param.is_cuda == (device == "cuda")
                                                  for param in trainer.model.parameters())
        assert all(param.dtype == torch.float32 for param in trainer.model.parameters())  # float32 master weights
    assert (logprobs["cuda"] - logprobs["cpu"]).abs().mean() < 0.02
    assert torch.nn.functional.cosine_similarity(grads["cuda"], grads["cpu"], dim=0) > 0.99


def _bare_step(model, optimizer, input_ids, attention_mask, mask, advantages) -> None:
    """What a plain torch training loop does: the whole logits, bf16 autocast, one backward, a clipped AdamW step."""
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1]
    taken = logits.float().log_softmax(-1).gather(2, input_ids[:, 1:, None]).squeeze(-1)
    loss = -(taken * mask * advantages[:, None]).sum() / mask.sum()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _seconds(step, repeats: int = 5) -> float:
    step()  # warm-up: kernels chosen, memory pooled
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats


def _bare_seconds(model_dir, batch: TrainBatch) -> tuple[float, int]:
    """A bare loop's seconds per step on ``batch``, and the model's parameter count."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    input_ids, attention_mask, mask = (tensor.cuda() for tensor in
                                       pad_sequences(batch.prompt_ids, batch.response_ids, 0))
    advantages = torch.tensor(batch.advantages, device="cuda")
    seconds = _seconds(lambda: _bare_step(model, optimizer, input_ids, attention_mask, mask, advantages))
    return seconds, sum(param.numel() for param in model.parameters())


@pytest.mark.parametrize("name", ["smollm2-135m", "llama-1b"])
def test_throughput_against_a_bare_torch_loop_and_peak_memory_against_the_estimate(model_dirs, name: str) -> None:
    batch, tokens = _batch(), ROWS * (PROMPT + RESPONSE)
    bare, parameters = _bare_seconds(model_dirs[name], batch)
    torch.cuda.empty_cache()
    trainer = _trainer(model_dirs[name], "cuda", "bfloat16", activation_checkpointing=True)
    torch.cuda.reset_peak_memory_stats()

    def step() -> None:
        trainer.accumulate(batch)
        trainer.apply_step()

    ours = _seconds(step)
    peak = torch.cuda.max_memory_allocated()
    estimate = trainer_peak_bytes(json.loads((model_dirs[name] / "architecture.json").read_text()),
                                  parameters=parameters, trainable=parameters, tokens=tokens)
    figure = {"gpu": torch.cuda.get_device_name(), "tokens_per_s": tokens / ours, "bare_tokens_per_s": tokens / bare,
              "throughput_ratio": bare / ours, "peak_gib": peak / 2**30, "estimate_gib": estimate / 2**30}
    print(json.dumps({name: figure}))  # BENCHMARKS.md takes its figures from here (pytest -s)
    assert figure["throughput_ratio"] >= 0.9, figure
    assert abs(peak / estimate - 1) <= 0.1, figure


def test_an_offloaded_trainer_frees_its_gpu_and_steps_on_as_one_never_offloaded(model_dirs) -> None:
    """A colocated agent's trainer between its turns (cluster/colocation.py): offloaded, its weights, gradients and
    AdamW state leave the GPU (under 1% of the state stays allocated); loaded back, its next steps are bit for bit
    those of a trainer that never left it."""
    kept, moved = (_trainer(model_dirs["smollm2-135m"], "cuda", "bfloat16") for _ in range(2))
    for step in range(3):
        for trainer in (kept, moved):
            trainer.accumulate(_batch(seed=step, rows=4))
            trainer.apply_step()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        state = moved.offload()
        freed = before - torch.cuda.memory_allocated()
        assert state > 0 and freed >= 0.99 * state, (state, freed)
        assert all(not param.is_cuda for param in moved.model.parameters())
        assert moved.onload() == state
    for a, b in zip(kept.model.parameters(), moved.model.parameters()):
        assert torch.equal(a, b)
    for a, b in zip(kept.optimizer.state.values(), moved.optimizer.state.values()):
        assert all(torch.equal(a[name], b[name]) for name in a)
