"""How a trainer cuts a micro-batch into forward/backward passes: packed or padded (training/packing.py says which
and why), the token budget a pass holds (given, a CPU's default, or sized to a GPU's free memory by
training/memory.py at the first pass), and the output head (fused or chunked: training/head.py). The one place a
trainer's pass settings are decided and reported."""

from __future__ import annotations

import torch

from marl_pipeline.training import memory, packing
from marl_pipeline.training.batches import length_chunks

CPU_CHUNK_TOKENS = 2048
"""A CPU trainer's tokens a pass when ``chunk_tokens`` is unset: what the CPU benchmarks were tuned at."""


class Passes:
    """One trainer's pass settings, over its policy (and KL reference) on its device."""

    def __init__(self, model, reference, device: torch.device, dtype: torch.dtype, *, chunk_tokens: int | None,
                 activation_checkpointing: bool, fused_head: bool | None, sharded: bool, pad_id: int) -> None:
        if chunk_tokens is not None and chunk_tokens < 1:
            raise ValueError(f"chunk_tokens {chunk_tokens}: expected a positive token budget per pass")
        self.model, self.reference, self.device, self.dtype = model, reference, device, dtype
        self.chunk_tokens = chunk_tokens  # None: sized at the first pass (:meth:`budget`)
        self.budget_why = "set" if chunk_tokens is not None else None
        self.activation_checkpointing, self.pad_id = activation_checkpointing, pad_id
        self.padded_why = packing.choose(model, device, dtype)  # None: packed passes
        # The head's terms in one pass a chunk, compiled on a GPU (unset: there, on one worker; FSDP's root holds the
        # sharded head's weight only while its own forward runs)
        self.fused_head = device.type == "cuda" and not sharded if fused_head is None else fused_head
        if self.padded_why is None:
            for policy in (model, reference):
                if policy is not None:
                    packing.use_varlen(policy)

    def chunks(self, lengths: list[int]) -> list[list[int]]:
        """Rows cut into passes: packed under the token budget, or sorted and padded under it."""
        budget = self.budget()
        return packing.packed_chunks(lengths, budget) if self.padded_why is None else length_chunks(lengths, budget)

    def build(self, prompts: list[list[int]], responses: list[list[int]]) -> packing.Pass:
        """A pass's inputs on the host, packed or padded as this trainer computes."""
        if self.padded_why is None:
            return packing.packed_pass(prompts, responses)
        return packing.padded_pass(prompts, responses, self.pad_id)

    def budget(self) -> int:
        """``chunk_tokens``; unset, a CPU's :data:`CPU_CHUNK_TOKENS`, or on a GPU the most tokens whose estimated peak
        (training/memory.py) fits in :data:`memory.PASS_SHARE` of the memory free at the first pass (a colocated engine
        asleep by then) and the trainer's own."""
        if self.chunk_tokens is None:
            if self.device.type != "cuda":
                self.chunk_tokens, self.budget_why = CPU_CHUNK_TOKENS, "the CPU's default"
            else:
                free, _ = torch.cuda.mem_get_info(self.device)
                available = memory.PASS_SHARE * (free + torch.cuda.memory_allocated(self.device))
                parameters = sum(param.numel() for param in self.model.parameters())
                trainable = sum(param.numel() for param in self.model.parameters() if param.requires_grad)
                self.chunk_tokens = memory.token_budget(
                    memory.architecture(self.model), parameters=parameters, trainable=trainable, available=available,
                    reference=self.reference is not None, activation_checkpointing=self.activation_checkpointing,
                    fused_head=self.fused_head)
                self.budget_why = f"sized to {available / 2**30:.1f} GiB of {torch.cuda.get_device_name(self.device)}"
        return self.chunk_tokens

    @property
    def kind(self) -> str:
        return "packed" if self.padded_why is None else "padded"

    def settings(self) -> dict:
        """For the run's log: packed or padded (and why), the token budget (and where it came from; None until the
        first pass sizes it), the head, the device and precision."""
        return {"passes": self.kind, "padded_why": self.padded_why, "chunk_tokens": self.chunk_tokens,
                "budget_why": self.budget_why, "head": "fused" if self.fused_head else "chunked",
                "device": torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu",
                "dtype": str(self.dtype).removeprefix("torch.")}
