"""Policy trainer: one agent's torch model and AdamW optimizer; run in-process or as a Ray actor.

One optimizer step = one RL step. Micro-batches arrive one at a time through :meth:`accumulate`
(summed token loss, backward, gradients add up); :meth:`apply_step` divides the gradients by the
step's total response-token count, clips and steps. This is exactly the full-batch update of the
token-mean loss over the whole step, whatever the micro-batch sizes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from marl_pipeline.runtime.losses import clipped_pg_loss_sum, pad_sequences, token_logprobs
from marl_pipeline.runtime.models import load_policy, save_policy


@dataclass(frozen=True)
class TrainBatch:
    """One agent's shard of one micro-batch: built by the train stage from the store, consumed here."""

    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    old_logprobs: list[list[float]]
    advantages: list[float]


@dataclass(frozen=True)
class StepResult:
    """One optimizer step of one agent: produced by :meth:`PolicyTrainer.apply_step`, consumed by the
    orchestrator's publisher (stored in the version's ``timing.json``)."""

    policy_version: int
    """The version the step produced."""
    tokens: int
    """Response tokens the step's gradient was normalised by."""
    grad_norm: float
    """Gradient norm before clipping."""
    lr: float
    """Learning rate of the step."""


class PolicyTrainer:
    """Holds one agent's policy in float32 and updates it with the clipped policy-gradient loss."""

    def __init__(self, model_dir: str, version: int, *, lr: float, weight_decay: float, max_grad_norm: float,
                 clip_eps: float, seed: int, num_threads: int | None = None, lr_decay_steps: int | None = None,
                 min_lr_ratio: float = 0.1) -> None:
        if num_threads:
            torch.set_num_threads(num_threads)
        torch.manual_seed(seed)
        self.model, self.tokenizer = load_policy(model_dir)
        self.model.train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=weight_decay)
        self.lr, self.lr_decay_steps, self.min_lr_ratio = lr, lr_decay_steps, min_lr_ratio
        self.max_grad_norm = max_grad_norm
        self.clip_eps = clip_eps
        self.version = version
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self._step_tokens = 0

    def accumulate(self, batch: TrainBatch) -> dict[str, float]:
        """Add one micro-batch's gradient of the summed token loss; returns its statistics."""
        if not batch.prompt_ids:
            return {"rows": 0, "tokens": 0, "loss_sum": 0.0, "clip_fraction": 0.0, "mean_ratio": 1.0,
                    "policy_version": self.version}
        input_ids, attention_mask, mask = pad_sequences(batch.prompt_ids, batch.response_ids, self.pad_id)
        old = torch.zeros_like(mask)
        for row, (prompt, logprobs) in enumerate(zip(batch.prompt_ids, batch.old_logprobs)):
            old[row, len(prompt) - 1 : len(prompt) - 1 + len(logprobs)] = torch.tensor(logprobs)
        advantages = torch.tensor(batch.advantages, dtype=torch.float32)
        logprobs = token_logprobs(self.model, input_ids, attention_mask)
        loss_sum, stats = clipped_pg_loss_sum(logprobs, old, advantages, mask, self.clip_eps)
        loss_sum.backward()
        tokens = int(mask.sum())
        self._step_tokens += tokens
        return {"rows": len(batch.prompt_ids), "tokens": tokens, "loss_sum": float(loss_sum.detach()),
                "policy_version": self.version, **stats}

    def apply_step(self) -> StepResult:
        """Turn the accumulated gradients into one optimizer step; the policy version goes up by one."""
        tokens = max(self._step_tokens, 1)
        for param in self.model.parameters():
            if param.grad is not None:
                param.grad.div_(tokens)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        for group in self.optimizer.param_groups:
            group["lr"] = self.learning_rate(self.version)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._step_tokens = 0
        self.version += 1
        return StepResult(self.version, tokens, float(grad_norm), self.learning_rate(self.version - 1))

    def learning_rate(self, version: int) -> float:
        """The step's learning rate, a function of the policy version, so a resumed launch continues the schedule."""
        if not self.lr_decay_steps:
            return self.lr
        return self.lr * max(self.min_lr_ratio, 1.0 - version / self.lr_decay_steps)

    def discard_gradients(self) -> None:
        """Drop accumulated gradients without stepping (a recomputed micro-batch, a failed step)."""
        self.optimizer.zero_grad(set_to_none=True)
        self._step_tokens = 0

    def named_weights(self) -> list[tuple[str, torch.Tensor]]:
        """Detached copies of the parameters in Hugging Face naming, ready for an engine's reload."""
        return [(name, tensor.detach().clone()) for name, tensor in self.model.state_dict().items()]

    def save(self, directory: str) -> None:
        from pathlib import Path

        save_policy(self.model, self.tokenizer, Path(directory))

    @torch.no_grad()
    def completion_logprobs(self, prompt_ids: list[int], response_ids: list[int]) -> list[float]:
        """The trainer's logprob of each response token given the prompt."""
        input_ids, attention_mask, mask = pad_sequences([prompt_ids], [response_ids], self.pad_id)
        logprobs = token_logprobs(self.model, input_ids, attention_mask)
        return logprobs[0][mask[0].bool()].tolist()

    def policy_version(self) -> int:
        return self.version
