"""Policy trainer: one agent's torch model and AdamW optimizer, on the device its Ray resources give it (CUDA with a
GPU, else the CPU); run in-process or as a Ray actor. The one training loop: RL's micro-batches and the warm-up's
supervised batches (:class:`SupervisedBatch`) go through the same passes, precision and step.

One optimizer step = one RL step. Micro-batches arrive one at a time through :meth:`accumulate`
(summed loss, backward, gradients add up); :meth:`apply_step` divides the gradients by the step's
total response-token count (or sequence count, with sequence normalisation), clips and steps. This is
exactly the full-batch update of the mean loss over the whole step, whatever the micro-batch sizes.

Inside a micro-batch, rows are cut into passes of at most ``chunk_tokens`` tokens (training/passes.py): on a GPU
packed, no padding; elsewhere sorted by length and padded. The loss is a sum, so the passes' gradients add up to the
micro-batch's. Every step reports its tokens a second and MFU (training/flops.py).
"""

from __future__ import annotations

import copy
import gc
import time
from pathlib import Path

import torch

from marl_pipeline.policy import transfer
from marl_pipeline.policy.checkpoint import TRAINER_STATE, load_policy, save_policy
from marl_pipeline.policy.lora import (
    POLICY,
    add_named_adapters,
    lora_policy,
    merged_weights,
    named_adapter_dirs,
    use_adapter,
)
from marl_pipeline.policy.precision import autocast, resolve_dtype
from marl_pipeline.training import flops, memory, sharded
from marl_pipeline.training.batches import SUPERVISED_TERMS, StepResult, SupervisedBatch, TrainBatch, rows_by_adapter
from marl_pipeline.training.losses import (
    TokenTerms,
    clip_fraction,
    grpo_token_loss,
    mismatch_stats,
    pad_sequences,
    scored_token_terms,
)
from marl_pipeline.training.passes import Passes


class PolicyTrainer:
    """Holds one agent's policy (float32 weights) and updates it with GRPO's clipped policy-gradient loss, plus
    optional KL-to-reference and entropy terms."""

    load = staticmethod(load_policy)
    """How a full policy is read, (model, tokenizer): float32 (exactness tests read it in float64)."""

    def __init__(self, model_dir: str, version: int, *, lr: float, weight_decay: float, max_grad_norm: float,
                 clip_eps: float, seed: int, num_threads: int | None = None, lr_decay_steps: int | None = None,
                 min_lr_ratio: float = 0.1, kl_coef: float = 0.0, reference_dir: str | None = None,
                 entropy_coef: float = 0.0, loss_normalization: str = "token", tis_cap: float | None = None,
                 dtype: str = "float32", chunk_tokens: int | None = None, lora: dict | None = None,
                 base_dir: str | None = None, activation_checkpointing: bool = False,
                 device: str | None = None, rank: sharded.Rank | None = None, fused_head: bool | None = None) -> None:
        if num_threads:
            torch.set_num_threads(num_threads)
        self.num_threads = torch.get_num_threads()  # what cluster/cores.py's split of the cores reads and moves
        torch.manual_seed(seed)
        # LoRA (policy/lora.py): ``lora`` is the agent's LoraAdapterConfig as a dict; ``base_dir`` its version 0.
        self.lora = lora is not None
        self.model, self.tokenizer = (lora_policy(model_dir, version, base_dir, **lora) if self.lora
                                      else self.load(model_dir))
        # Version 0's named adapters (``adapters/<name>/``), frozen: on for the rows whose turns they served.
        adapter_dirs = named_adapter_dirs(base_dir) if self.lora else {}
        self.named_adapters = set(adapter_dirs)
        if adapter_dirs:
            add_named_adapters(self.model, adapter_dirs)
        # None: the device the actor's Ray resources give it (Ray hides every GPU from an actor without num_gpus).
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.device_type = self.device.type
        self.model.to(self.device).train()
        if activation_checkpointing:  # layer activations recomputed in the backward pass: memory for compute
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        # One of the agent's ``trainer.workers`` (training/sharded.py): the weights sharded over them by FSDP2.
        self.rank, self.scorer = rank, None
        if rank is not None:
            if self.lora:
                raise ValueError("a LoRA agent trains on one worker (its adapters are small): set trainer.workers: 1")
            sharded.join(rank, self.device)
            self.scorer = sharded.shard(self.model)
        self.dtype = resolve_dtype(dtype, self.device_type)
        self.parameters = sum(param.numel() for param in self.model.parameters())
        # Only the trainable parameters (all of them, or a LoRA agent's adapters): AdamW keeps moments for these.
        trainable = [param for param in self.model.parameters() if param.requires_grad]
        # Fused on a GPU: one kernel, and no parameter-sized temporaries in the step (training/memory.py).
        self.optimizer = torch.optim.AdamW(trainable, lr=lr, weight_decay=weight_decay,
                                           fused=True if self.device_type == "cuda" else None)
        self.resumed_optimizer = self._load_state(Path(model_dir) / TRAINER_STATE, version)
        self.lr, self.lr_decay_steps, self.min_lr_ratio = lr, lr_decay_steps, min_lr_ratio
        self.max_grad_norm = max_grad_norm
        self.clip_eps, self.tis_cap = clip_eps, tis_cap
        self.kl_coef, self.entropy_coef = kl_coef, entropy_coef
        if loss_normalization not in ("token", "sequence"):
            raise ValueError(f"loss_normalization {loss_normalization!r}: expected 'token' or 'sequence'")
        self.loss_normalization = loss_normalization
        self.reference = None
        if kl_coef > 0:
            if reference_dir is None:
                raise ValueError("kl_coef > 0 needs reference_dir (the agent's base policy)")
            # A second, frozen copy of the weights: + 4 bytes per parameter, a quarter more than the policy's
            # own float32 weights, gradients and AdamW moments (16 bytes per parameter); and one more forward
            # pass (no backward) per micro-batch.
            self.reference, _ = self.load(reference_dir)
            self.reference.to(self.device).eval().requires_grad_(False)
        self.version = version
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.passes = Passes(self.model, self.reference, self.device, self.dtype, chunk_tokens=chunk_tokens,
                             activation_checkpointing=activation_checkpointing, fused_head=fused_head,
                             sharded=rank is not None, pad_id=self.pad_id)
        self._step_tokens = self._step_sequences = 0
        self._work = flops.StepWork()  # real tokens and seconds since the last step, for its MFU
        self._outbox = transfer.Outbox()  # versions staged for a weight broadcast

    def restart(self, *args, **kwargs) -> bool:
        """Become the trainer ``__init__(*args, **kwargs)`` builds, in this process (a kept actor taken by a new
        launch: cluster/warm_actors.py): everything is rebuilt, so nothing of the last launch carries over."""
        vars(self).clear()
        gc.collect()  # the old weights and AdamW moments, before the new ones are loaded
        type(self).__init__(self, *args, **kwargs)
        return True

    def accumulate(self, batch: TrainBatch) -> dict[str, float]:
        """Add one micro-batch's gradient of the summed loss, in passes of at most ``chunk_tokens`` tokens; returns
        its statistics, with the seconds it computed (the stage's span less this is overhead)."""
        began = time.perf_counter()
        if not batch.prompt_ids:
            self._idle_passes(self._passes_short(0))
            return {"rows": 0, "tokens": 0, "loss_sum": 0.0, "clip_fraction": 0.0, "mean_ratio": 1.0,
                    "mismatch_abs_logprob": 0.0, "mismatch_ratio_std": 0.0, "policy_version": self.version,
                    "dropped_rows": batch.dropped_rows, "compute_seconds": time.perf_counter() - began}
        lengths = [len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids)]
        plan = [(adapter, [rows[i] for i in chunk])  # a pass computes with one set of adapters
                for adapter, rows in rows_by_adapter(batch)
                for chunk in self.passes.chunks([lengths[row] for row in rows])]
        idle = self._passes_short(len(plan))
        passes = []
        for adapter, rows in plan:
            self._use_adapter(adapter)
            passes.append(self._accumulate_rows(batch, rows))
        self._use_adapter(None)
        self._idle_passes(idle)
        # Statistics over the response tokens of every pass, as if the micro-batch had been one tensor; masked, not
        # selected, so that a GPU waits for them once a micro-batch (a boolean index is a device-to-host sync).
        logprobs, engine, ratio, mask = (torch.cat([p[i] for p in passes])[None] for i in range(4))
        tokens = sum(p[4] for p in passes)
        self._step_tokens += tokens
        self._step_sequences += sum(p[5] for p in passes)
        stats = {"rows": len(batch.prompt_ids), "tokens": tokens, "loss_sum": float(sum(p[6] for p in passes)),
                 "policy_version": self.version, "dropped_rows": batch.dropped_rows,
                 "clip_fraction": clip_fraction(ratio, mask, self.clip_eps), **mismatch_stats(logprobs, engine, mask)}
        self._work.add(sum(lengths), began)  # after the figures' read: the GPU has finished the passes
        return {**stats, "compute_seconds": time.perf_counter() - began}

    def pass_settings(self) -> dict:
        """How this trainer's passes run, for the run's log (:meth:`Passes.settings`)."""
        return self.passes.settings()

    def _passes_short(self, passes: int) -> int:
        # FSDP's collectives run per pass: every rank runs as many (training/sharded.py)
        return 0 if self.scorer is None else sharded.passes_short(passes)

    def _idle_passes(self, count: int) -> None:
        for _ in range(count):
            sharded.idle_pass(self.scorer, self.pad_id, self.device)

    def _terms(self, *args, **kwargs) -> TokenTerms:
        """The policy's token terms (``scored_token_terms``), through FSDP's root on a sharded trainer."""
        if self.scorer is not None:
            return self.scorer.terms(*args, **kwargs)
        return scored_token_terms(self.model, *args, fused=self.passes.fused_head, **kwargs)

    def _use_adapter(self, adapter: str | None) -> None:
        if adapter is not None and adapter not in self.named_adapters:
            raise ValueError(f"adapter {adapter!r}: the trainer's version 0 has "
                             f"{sorted(self.named_adapters) or 'no named adapters'}")
        if self.named_adapters:
            use_adapter(self.model, adapter)

    def _accumulate_rows(self, batch: TrainBatch, rows: list[int]):
        """One forward/backward pass over some rows of a micro-batch. Returns the trainer logprobs, engine logprobs,
        clip ratios and the response tokens' mask (flat, every position), the token and sequence counts, and the
        summed loss (a tensor: read once a micro-batch)."""
        built = self.passes.build([batch.prompt_ids[row] for row in rows], [batch.response_ids[row] for row in rows])
        counts = built.counts()
        engine, advantages, weights = (built.spread([batch.old_logprobs[row] for row in rows]),
                                       built.spread([batch.advantages[row] for row in rows]),
                                       built.loss_weights(self.loss_normalization))
        engine, advantages, weights = (tensor.to(self.device) for tensor in (engine, advantages, weights))
        built = built.to(self.device)
        mask, taken = built.mask, built.mask.bool()
        entropy = ref_logprobs = None
        with autocast(self.dtype, self.device_type):
            terms = self._terms(built.input_ids, built.attention_mask, taken, entropy=self.entropy_coef > 0,
                                packing=built.packing)
            if self.reference is not None:
                with torch.no_grad():
                    ref_logprobs = scored_token_terms(self.reference, built.input_ids, built.attention_mask, taken,
                                                      packing=built.packing).scattered("logprobs", taken)
        logprobs = terms.scattered("logprobs", taken)
        if terms.entropy is not None:
            entropy = terms.scattered("entropy", taken)
        token_loss, ratio = grpo_token_loss(logprobs, engine, advantages, self.clip_eps, tis_cap=self.tis_cap,
                                            ref_logprobs=ref_logprobs, kl_coef=self.kl_coef, entropy=entropy,
                                            entropy_coef=self.entropy_coef)
        loss_sum = (token_loss * weights).sum()
        loss_sum.backward()
        return (logprobs.detach().flatten(), engine.flatten(), ratio.detach().flatten(), mask.flatten(), *counts,
                loss_sum.detach())

    def keep_start_copy(self) -> None:
        """Freeze a copy of the policy as it is now as the reference (a warm-up's rehearsal keeps to where it
        started)."""
        self.reference = copy.deepcopy(self.model).eval().requires_grad_(False)

    def accumulate_supervised(self, batch: SupervisedBatch) -> dict[str, float]:
        """Add one supervised batch's gradient of its summed loss (every response token counts in the step's
        token total), in the same passes as :meth:`accumulate`; returns its token count and loss."""
        unknown = sorted(set(batch.terms) - set(SUPERVISED_TERMS))
        if unknown or len(batch.terms) != len(batch.prompt_ids):
            raise ValueError(f"supervised terms {unknown or len(batch.terms)}: expected one of {SUPERVISED_TERMS} "
                             f"per row ({len(batch.prompt_ids)} rows)")
        if self.reference is None and set(batch.terms) - {"teach"}:
            raise ValueError("a supervised batch that keeps rows needs the reference model (keep_start_copy)")
        began = time.perf_counter()
        lengths = [len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids)]
        tokens, loss = 0, 0.0
        for chunk in self.passes.chunks(lengths):
            built = self.passes.build([batch.prompt_ids[row] for row in chunk],
                                      [batch.response_ids[row] for row in chunk])
            weight = {name: built.spread([float(batch.terms[row] == name) for row in chunk]).to(self.device)
                      for name in SUPERVISED_TERMS}
            built = built.to(self.device)
            mask, taken = built.mask, built.mask.bool()
            kept = [batch.terms[row] != "teach" for row in chunk]
            with autocast(self.dtype, self.device_type):
                terms = self._terms(built.input_ids, built.attention_mask, taken,
                                    start=self.reference if any(kept) else None, packing=built.packing)
            logprobs = terms.scattered("logprobs", taken)
            token_loss = -logprobs * weight["teach"]
            if any(kept):
                path = logprobs - terms.scattered("start_logprobs", taken)
                token_loss = token_loss + terms.scattered("start_kl", taken) * (weight["keep"] + weight["keep_path"])
                token_loss = token_loss + path ** 2 * weight["keep_path"]
            chunk_loss = token_loss.sum()
            chunk_loss.backward()
            tokens += int(mask.sum())
            loss += float(chunk_loss.detach())
        self._step_tokens += tokens
        self._step_sequences += len(batch.prompt_ids)
        self._work.add(sum(lengths), began)
        return {"rows": len(batch.prompt_ids), "tokens": tokens, "loss_sum": loss}

    def apply_step(self) -> StepResult:
        """Turn the accumulated gradients into one optimizer step; the policy version goes up by one."""
        peak = flops.peak_flops(self.device, self.dtype)  # measured once (per thread count on a CPU), untimed
        began = time.perf_counter()
        computed = self._work.tokens
        if self.rank is not None:  # every rank divides by the step's counts over all of them
            self._step_tokens, self._step_sequences, computed = sharded.summed(
                self._step_tokens, self._step_sequences, computed)
        units = self._step_tokens if self.loss_normalization == "token" else self._step_sequences
        # One kernel for every gradient, not one a parameter (a GPU step is launch-bound at small batches). None at all:
        # the agent had no turn this step (a game that ended before its seat moved); the version goes up unchanged.
        if grads := [param.grad for param in self.model.parameters() if param.grad is not None]:
            torch._foreach_div_(grads, float(max(units, 1)))
        grad_norm = sharded.full_norm(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm))
        for group in self.optimizer.param_groups:
            group["lr"] = self.learning_rate(self.version)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        grad_norm = float(grad_norm)  # waits for the optimizer's kernels too: the step's time is all of it
        figures = self._work.figures(self.parameters, peak, computed, self._work.seconds + time.perf_counter() - began,
                                     self.rank.world if self.rank is not None else 1)
        result = StepResult(self.version + 1, self._step_tokens, self._step_sequences, grad_norm,
                            self.learning_rate(self.version), **figures,
                            chunk_tokens=self.passes.chunk_tokens or 0, passes=self.passes.kind)
        self._step_tokens = self._step_sequences = 0
        self._work = flops.StepWork()
        self.version += 1
        return result

    def learning_rate(self, version: int) -> float:
        """The step's learning rate, a function of the policy version, so a resumed launch continues the schedule."""
        if not self.lr_decay_steps:
            return self.lr
        return self.lr * max(self.min_lr_ratio, 1.0 - version / self.lr_decay_steps)

    def discard_gradients(self) -> None:
        """Drop accumulated gradients without stepping (a recomputed micro-batch, a failed step)."""
        self.optimizer.zero_grad(set_to_none=True)
        self._step_tokens = self._step_sequences = 0
        self._work = flops.StepWork()

    def offload(self) -> int:
        """Weights, gradients, AdamW state and KL reference to host memory, freeing the GPU for the agent's engine
        (``agents.<a>.colocated``); bytes moved, 0 on a CPU (nothing to free)."""
        return self._move_state(torch.device("cpu"))

    def onload(self) -> int:
        """Back onto the trainer's GPU after :meth:`offload`; bytes moved."""
        return self._move_state(self.device)

    def _move_state(self, device: torch.device) -> int:
        on_gpu = self.device_type == "cuda"
        return memory.move_state([self.model, self.reference], self.optimizer, device) if on_gpu else 0

    def named_weights(self) -> list[tuple[str, torch.Tensor]]:
        """Detached copies of the parameters in Hugging Face naming, ready for an engine's reload (a LoRA agent's
        with its adapters merged in); on a sharded trainer, rank 0 gets them all and the other ranks none."""
        fresh = self.scorer is not None or self.lora  # gathered or merged: new tensors already, no second copy
        return [(name, tensor.to("cpu", copy=not fresh)) for name, tensor in self._exported()]

    def _exported(self) -> list[tuple[str, torch.Tensor]]:
        """The weights as engines load them, uncopied where they are the live parameters."""
        if self.scorer is not None:
            return list(sharded.gathered_weights(self.model).items())
        if self.lora:
            return list(merged_weights(self.model))
        return [(name, tensor.detach()) for name, tensor in self.model.state_dict().items()]

    def stage_weights(self) -> transfer.Manifest | None:
        """Snapshot the version just stepped to for :meth:`send_weights` (in call order, so a later step cannot change
        what is sent) and return the manifest its receivers allocate; None on a sharded trainer's other ranks."""
        return self._outbox.stage(self.version, self._exported(), self.device)

    def weights_address(self) -> str:
        """Where this trainer's weight broadcasts meet their engine replicas (policy/transfer.py)."""
        return self._outbox.endpoint.address()

    def send_weights(self, group: transfer.SyncGroup, version: int) -> int:
        """Broadcast a staged version to ``group``'s engine replicas (as a Ray actor, beside the trainer's other calls:
        cluster/trainers.py)."""
        return self._outbox.send(group, version)

    def staged_weights(self, version: int) -> list[tuple[str, torch.Tensor]]:
        """A staged version's weights in host memory, for an engine replica restarted after a broadcast."""
        return self._outbox.copy(version)

    def save(self, directory: str) -> None:
        """The policy (Hugging Face format, what engines load; a LoRA agent's adapters only) and the trainer state
        a resumed launch needs. A sharded trainer's ranks gather both to rank 0, which writes them as one worker
        does."""
        weights = None if self.scorer is None else sharded.gathered_weights(self.model)
        optimizer = (self.optimizer.state_dict() if self.scorer is None
                     else sharded.gathered_optimizer_state(self.scorer, self.optimizer))
        if self.rank is not None and self.rank.rank:
            return
        if self.lora:
            # A PeftModel saves its adapters, not the frozen base; the warm-up's stay in version 0 alone.
            self.model.save_pretrained(directory, selected_adapters=[POLICY])
        else:
            save_policy(self.model, self.tokenizer, Path(directory), state_dict=weights)
        torch.save({"version": self.version, "optimizer": optimizer, "rng": torch.get_rng_state(),
                    **({"cuda_rng": torch.cuda.get_rng_state()} if self.device_type == "cuda" else {})},
                   Path(directory) / TRAINER_STATE)

    def _load_state(self, path: Path, version: int) -> bool:
        """Restore AdamW and the RNG saved with ``version``; False when there is none (a base policy, or a version
        saved before complete checkpoints), and AdamW starts fresh."""
        if not path.exists():
            return False
        state = torch.load(path, map_location="cpu", weights_only=True)  # AdamW's load moves it to the parameters
        if state["version"] != version:
            raise ValueError(f"{path} holds the trainer state of version {state['version']}, not {version}")
        if self.scorer is None:
            self.optimizer.load_state_dict(state["optimizer"])
        else:
            sharded.load_optimizer_state(self.scorer, self.optimizer, state["optimizer"])
        torch.set_rng_state(state["rng"])
        if "cuda_rng" in state and self.device_type == "cuda":
            torch.cuda.set_rng_state(state["cuda_rng"])
        return True

    @torch.no_grad()
    def completion_logprobs(self, prompt_ids: list[int], response_ids: list[int],
                            adapter: str | None = None) -> list[float]:
        """The trainer's logprob of each response token given the prompt, with the named ``adapter`` active too."""
        input_ids, attention_mask, mask = (tensor.to(self.device) for tensor in
                                           pad_sequences([prompt_ids], [response_ids], self.pad_id))
        self._use_adapter(adapter)
        try:
            with autocast(self.dtype, self.device_type):
                return self._terms(input_ids, attention_mask, mask.bool()).logprobs.tolist()
        finally:
            self._use_adapter(None)

    def policy_version(self) -> int:
        return self.version
