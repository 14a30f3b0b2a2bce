"""One agent's settings: its model, rollout engine, trainer, warm-up, LoRA and its own algorithm values."""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from marl_pipeline.config.algorithm import AgentAlgorithm
from marl_pipeline.config.base import BUILTIN_TINY, StrictModel

ADAPTER_NAME = r"^[A-Za-z][A-Za-z0-9_-]{0,63}$"  # a folder name and peft adapter name ("default" is RL's own)


def adapter_of_turn(turn_adapters: dict[str, list[int]], own_turn: int) -> str | None:
    """The named adapter of an agent's ``turn_adapters`` that serves its ``own_turn`` (0: its first), or None."""
    return next((name for name, turns in turn_adapters.items() if own_turn in turns), None)


def turn_adapter(turn_adapters: dict[str, dict[str, list[int]]], role: str, earlier: list[str]) -> str | None:
    """The named adapter that serves ``role``'s next turn (None: the policy's weights alone), after the turns of the
    roles ``earlier`` in the episode, from every agent's ``turn_adapters``."""
    return adapter_of_turn(turn_adapters.get(role, {}), earlier.count(role))


def episode_adapters(turn_adapters: dict[str, dict[str, list[int]]], turn_order: list[str]) -> list[str | None]:
    """The named adapter that serves each turn of an episode whose roles speak in ``turn_order``."""
    return [turn_adapter(turn_adapters, role, list(turn_order[:turn])) for turn, role in enumerate(turn_order)]


class EngineConfig(StrictModel):
    """Rollout engine (vLLM) settings for one agent."""

    gpu_memory_utilization: float = Field(0.15, gt=0, le=1)
    """Share of device memory for weights + KV cache (CPU: of NUMA node 0's memory, engine process included)."""
    kv_cache_gib: float | None = Field(None, gt=0)
    """The KV cache's size in GiB (vLLM's ``kv_cache_memory_bytes``; ``gpu_memory_utilization`` is then ignored):
    exactly this much cache for the engine's sequences and the prefixes it keeps, whatever the process holds. None: on
    a CPU, room for every sequence at full length twice over, where the share gives more (``engine.kv_cache_bytes``)."""
    max_model_len: int = Field(256, ge=16)
    """Longest prompt + completion the engine accepts, in tokens."""
    dtype: str = "float32"
    """Engine dtype; float32 keeps the engine's logprobs comparable with the trainer's."""
    num_cpus: float = Field(0.5, ge=0)
    """Ray CPUs reserved for the engine actor."""
    num_gpus: float = Field(0.0, ge=0)
    """Ray GPUs reserved for the engine actor (0 on CPU machines)."""
    replicas: int = Field(1, ge=1, le=64)
    """Engine actors serving this agent, each with these resources; routed per episode (inference/router.py)."""
    tensor_parallel_size: int = Field(1, ge=1, le=64)
    """GPUs of one node that one replica's model is split over (vLLM tensor parallelism): a placement group of one
    GPU bundle per rank; ``num_gpus`` must equal it."""
    max_outstanding: int | None = Field(None, ge=1)
    """Requests in flight on one replica beyond which a new episode waits for room rather than join it (None: no
    limit). An episode's later turns still go to its own replica."""
    threads: int | None = Field(None, ge=1)
    """CPU threads of the engine's forward passes; None: its share of the cluster's CPUs (cluster/spawn.py)."""


    @model_validator(mode="after")
    def _tensor_parallel_on_whole_gpus(self) -> EngineConfig:
        if self.tensor_parallel_size > 1 and self.num_gpus != self.tensor_parallel_size:
            raise ValueError(f"tensor_parallel_size {self.tensor_parallel_size} splits a replica over that many whole "
                             f"GPUs: set num_gpus to {self.tensor_parallel_size} (it is {self.num_gpus:g})")
        return self


class TrainerConfig(StrictModel):
    """Torch trainer settings for one agent."""

    lr: float = Field(1e-3, ge=0)
    """AdamW learning rate (peak, before decay). 0: the agent's weights stay version 0's (a frozen opponent, or a
    teammate held fixed); its trainer still computes each step and its versions still advance."""
    lr_decay_steps: int | None = Field(None, ge=1)
    """Linear decay of the learning rate over this many policy versions (None: constant)."""
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    """The decayed learning rate never goes below ``lr * min_lr_ratio``."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    max_grad_norm: float = Field(1.0, gt=0)
    """Gradient clipping norm, applied once per optimizer step."""
    num_cpus: float = Field(0.5, ge=0)
    """Ray CPUs reserved for the trainer actor."""
    num_gpus: float = Field(0.0, ge=0)
    """Ray GPUs reserved for the trainer actor."""
    threads: int | None = Field(None, ge=1)
    """CPU threads of the trainer's forward and backward passes; None as for ``EngineConfig.threads`` (for the
    trainer actor; a trainer built in-process, as a recomputation's, keeps its process's threads)."""
    chunk_tokens: int | None = Field(None, ge=1)
    """Tokens per forward/backward pass (packed on a GPU, padded on a CPU; the same gradient). None: sized to the
    free memory on a GPU, 2,048 on a CPU."""
    dtype: Literal["float32", "bfloat16", "auto"] = "float32"
    """``float32``, ``bfloat16`` (autocast over float32 weights), or ``auto`` (bf16 where the hardware has it)."""
    activation_checkpointing: bool = False
    """Recompute each layer's activations in the backward pass instead of keeping them: less memory, more compute."""
    workers: int = Field(1, ge=1, le=1024)
    """Ray actors training this agent together, each with these resources: FSDP2 shards its weights, gradients and
    AdamW state over them (training/sharded.py). Full fine-tuning only, never swapped."""

    @model_validator(mode="after")
    def _workers_reserve_something(self) -> TrainerConfig:
        if self.workers > 1 and self.num_cpus == 0 and self.num_gpus == 0:
            raise ValueError(f"trainer.workers {self.workers}: each worker is a placement group bundle, which cannot "
                             f"be empty: set num_cpus or num_gpus above 0")
        return self


class LoraAdapterConfig(StrictModel):
    """Train LoRA adapters (peft) on top of the agent's base policy (version 0) instead of every weight.

    The base stays frozen; versions after 0 store only the adapters and their AdamW state, and engines serve the
    base with the adapters merged in (``policy/lora.py``). No dropout: the trainer's logprobs must be the
    engine's, and dropout would make them differ on every training pass."""

    rank: int = Field(8, ge=1)
    """Rank r of each adapter (A is r x in, B is out x r)."""
    alpha: float = Field(16.0, gt=0)
    """Scale of the adapters' update: B A is multiplied by alpha / rank."""
    target_modules: str | list[str] = "all-linear"
    """Modules that get adapters: peft's ``all-linear`` (every linear layer but the output head), or module names
    (``[q_proj, v_proj]``) as peft matches them."""

    @field_validator("target_modules")
    @classmethod
    def _some_modules(cls, value: str | list[str]) -> str | list[str]:
        if not value or (isinstance(value, list) and not all(value)):
            raise ValueError("expected 'all-linear' or a non-empty list of module names")
        return value


class WarmupConfig(StrictModel):
    """Supervised warm-up of the base policy (version 0), before any RL step."""

    removed_keys: ClassVar[dict[str, str]] = {
        "separate": "warmup.separate is now warmup.adapter: NAME, with the turns it serves in the agent's "
                    "turn_adapters: {NAME: [own turns]}",
        "rehearse_context": "warmup.rehearse_context was removed: it gave RL no more right workings "
                            "(docs/ARCHITECTURE.md)"}

    steps: int = Field(150, ge=0)
    """Optimizer steps of warm-up; 0 uses the model as loaded."""
    batch_size: int = Field(32, ge=1)
    """Examples per warm-up step."""
    lr: float = Field(3e-3, gt=0)
    """Warm-up learning rate."""
    lora: LoraAdapterConfig | None = None
    """Warm up LoRA adapters (peft) instead of every weight, merged into version 0 (None: every weight)."""
    adapter: str | None = Field(None, pattern=ADAPTER_NAME)
    """Keep the warm-up's ``lora`` adapters apart as version 0's adapter of this name (``turn_adapters``)."""

    @model_validator(mode="after")
    def _adapter_needs_lora(self) -> WarmupConfig:
        if self.adapter and (self.lora is None or self.steps == 0):
            raise ValueError("warmup.adapter keeps the warm-up's LoRA adapters apart: it needs warmup.lora and "
                             "warmup.steps > 0")
        return self


class LengthLayout(StrictModel):
    """From an observed context length on, how many devices an agent's engine replica and trainer take (EARL): the
    ranges ``marl plan --by-length`` prints."""

    from_tokens: int = Field(ge=0)
    """The longest prompt + response of the agent's turns in a step from which the next step takes this layout."""
    tensor_parallel_size: int = Field(1, ge=1, le=64)
    """The engine replica's GPUs (``engine.num_gpus`` follows, one a rank)."""
    trainer_workers: int = Field(1, ge=1, le=1024)
    """The trainer's workers (``trainer.workers``), each with the trainer's ``num_cpus`` and ``num_gpus``."""


class AgentConfig(StrictModel):
    """One policy of the team: the role of the workflow named as the agent, or the ``roles`` it lists."""

    model: str = BUILTIN_TINY
    """``builtin:tiny``, a HF directory or hub id, a ``.gguf`` file, or a packaged short name."""
    roles: list[str] | None = Field(None, min_length=1)
    """The environment's roles this agent plays with its one policy (None: the role named as the agent). Several
    roles make a shared policy: one engine and one trainer serve them all, with one version line; each role's turns
    keep their own rows, groups and advantages, and its own held-out evaluation (AT-GRPO's shared-policy mode)."""
    engine: EngineConfig = EngineConfig()
    trainer: TrainerConfig = TrainerConfig()
    warmup: WarmupConfig = WarmupConfig()
    lora: LoraAdapterConfig | None = None
    """LoRA adapters trained over version 0 in place of the full weights (None: full fine-tuning)."""
    staleness: int | None = Field(None, ge=0)
    """The most policy versions this agent's turns may lag the step that trains on them (None: ``pipeline.staleness``):
    rollout of step s waits until this agent's engines serve a version of at least s - staleness, so a slow agent with
    a looser bound does not hold its teammates' rollout, and one with 0 is always sampled on-policy."""
    sync_every: int = Field(1, ge=1)
    """The agent's engines load its weights every this many of its versions (and the versions evaluated or ending a
    launch); its trainer still steps every step, so its turns may be sampled up to ``sync_every - 1`` versions
    behind, which its staleness bound must allow. For an agent whose weight sync costs more than the lag does."""
    algorithm: AgentAlgorithm = AgentAlgorithm()
    """This agent's own values of ``algorithm:`` fields (temperature, max_new_tokens, clip_eps, kl_coef,
    entropy_coef, advantage, loss_normalization, tis_cap, drop_zero_advantage_groups); a field not set (or null) is
    the experiment's."""
    turn_adapters: dict[Annotated[str, Field(pattern=ADAPTER_NAME)], list[Annotated[int, Field(ge=0)]]] = Field(
        default_factory=dict)
    """Version 0's named frozen adapters and the agent's own turns (0: its first) each serves over the RL weights."""
    colocated: bool = False
    """The agent's engine and trainer share its GPUs and take turns (FlexMARL's agent-centric allocation): while the
    trainer trains, the engine sleeps (vLLM's sleep level 1: KV cache freed, weights in host memory), and while the
    engine samples, the trainer's weights, gradients and AdamW state wait in host memory (cluster/colocation.py).
    Needs ``pipeline.mode: synchronous``, one engine replica, and ``trainer.workers`` equal to the engine's
    ``tensor_parallel_size`` with one GPU each (trainer rank k shares GPU k with engine rank k). Without GPUs only
    the turns are taken."""

    parallelism_by_length: list[LengthLayout] = Field(default_factory=list)
    """Layouts by observed context length, ``from_tokens`` increasing: at a step boundary where the agent's longest
    turn of the step reaches another entry's range, the run restarts its replicas and trainer with that entry's
    layout (run/layouts.py); below the first ``from_tokens``, ``engine`` and ``trainer`` as set."""

    hybrid: bool = False
    """The agent's trainer runs in the process of its engine's replica 0, as verl's hybrid engine (cluster/hybrid.py):
    one process imports torch, transformers and vLLM once, which shortens a CPU-bound start-up, and the two share
    one interpreter lock. On CPUs, with one trainer worker and one engine rank (``tensor_parallel_size: 1``)."""

    @model_validator(mode="after")
    def _roles_once_without_turn_adapters(self) -> AgentConfig:
        if self.roles is not None and len(set(self.roles)) < len(self.roles):
            raise ValueError(f"roles: {self.roles} names a role twice")
        if self.roles is not None and len(self.roles) > 1 and self.turn_adapters:
            raise ValueError("turn_adapters count one role's own turns; an agent playing several roles has none")
        return self

    @model_validator(mode="after")
    def _hybrid_on_one_cpu_process(self) -> AgentConfig:
        if not self.hybrid:
            return self
        engine, trainer = self.engine, self.trainer
        asks = {"engine.num_gpus": engine.num_gpus, "trainer.num_gpus": trainer.num_gpus,
                "trainer.workers": trainer.workers - 1, "engine.tensor_parallel_size": engine.tensor_parallel_size - 1}
        if wrong := [name for name, value in asks.items() if value]:
            raise ValueError(f"hybrid: the engine's replica 0 and the trainer share one CPU process, so it needs "
                             f"engine.num_gpus and trainer.num_gpus 0, trainer.workers and engine.tensor_parallel_size "
                             f"1; {', '.join(wrong)} differ (colocated shares GPUs between two processes)")
        if self.colocated:
            raise ValueError("hybrid and colocated: pick one (hybrid puts the trainer in the engine's process on CPUs; "
                             "colocated shares GPUs between the two)")
        return self

    @model_validator(mode="after")
    def _colocated_shares_whole_gpus(self) -> AgentConfig:
        if not self.colocated:
            return self
        engine, trainer = self.engine, self.trainer
        if engine.replicas != 1:
            raise ValueError(f"colocated: the engine and the trainer share the agent's GPUs, which one replica uses; "
                             f"engine.replicas is {engine.replicas}")
        if trainer.workers != engine.tensor_parallel_size:
            raise ValueError(f"colocated: trainer rank k shares GPU k with engine rank k, so trainer.workers "
                             f"({trainer.workers}) must equal engine.tensor_parallel_size "
                             f"({engine.tensor_parallel_size})")
        if (engine.num_gpus or trainer.num_gpus) and (trainer.num_gpus != 1 or engine.num_gpus != trainer.workers):
            raise ValueError(f"colocated: each of the {trainer.workers} shared GPUs holds one engine rank and one "
                             f"trainer rank: set trainer.num_gpus to 1 (it is {trainer.num_gpus:g}) and "
                             f"engine.num_gpus to {trainer.workers} (it is {engine.num_gpus:g}), or both to 0 on a CPU")
        return self

    @model_validator(mode="after")
    def _layouts_each_valid(self) -> AgentConfig:
        starts = [entry.from_tokens for entry in self.parallelism_by_length]
        if starts != sorted(set(starts)):
            raise ValueError(f"parallelism_by_length: from_tokens must increase from one entry to the next: {starts}")
        for index, entry in enumerate(self.parallelism_by_length):
            where = f"parallelism_by_length[{index}] (from {entry.from_tokens} tokens)"
            if entry.tensor_parallel_size > 1 and self.engine.num_gpus == 0:
                raise ValueError(f"{where}: tensor_parallel_size {entry.tensor_parallel_size} splits a replica over "
                                 f"GPUs, and engine.num_gpus is 0")
            try:
                self.laid_out(index)
            except ValidationError as error:
                raise ValueError(f"{where}: {error.errors()[0]['msg'].removeprefix('Value error, ')}") from None
        return self

    def laid_out(self, index: int | None) -> AgentConfig:
        """This agent with ``parallelism_by_length[index]``'s layout (None: as set): the engine's
        ``tensor_parallel_size`` (and ``num_gpus``, one a rank when split) and the trainer's ``workers``."""
        if index is None:
            return self
        entry, engine = self.parallelism_by_length[index], self.engine
        split = entry.tensor_parallel_size > 1
        gpus = entry.tensor_parallel_size if split else (engine.num_gpus if engine.tensor_parallel_size == 1
                                                         else 1.0)
        data = self.model_dump()
        data["engine"] |= {"tensor_parallel_size": entry.tensor_parallel_size, "num_gpus": gpus}
        data["trainer"]["workers"] = entry.trainer_workers
        laid = AgentConfig.model_validate({**data, "parallelism_by_length": []})
        return laid.model_copy(update={"parallelism_by_length": self.parallelism_by_length})

    def layout_at(self, length: int) -> int | None:
        """The entry of ``parallelism_by_length`` for an observed ``length`` (None: below every entry)."""
        return next((i for i in reversed(range(len(self.parallelism_by_length)))
                     if length >= self.parallelism_by_length[i].from_tokens), None)

    @model_validator(mode="after")
    def _workers_train_full_weights(self) -> AgentConfig:
        if self.trainer.workers > 1 and self.lora is not None:
            raise ValueError(f"trainer.workers {self.trainer.workers} shards full fine-tuning; a LoRA agent's "
                             f"adapters are small enough for one worker: set trainer.workers: 1 or remove lora")
        return self

    @model_validator(mode="after")
    def _turn_adapters_need_lora(self) -> AgentConfig:
        if self.turn_adapters and self.lora is None:
            raise ValueError("turn_adapters needs the agent's lora: its RL adapters are trained beside the named "
                             "ones, which engines serve per request (vLLM's LoRA) over the merged RL weights")
        if "default" in self.turn_adapters:
            raise ValueError("turn_adapters: 'default' is the name of the RL adapters; name the frozen one otherwise")
        turns = [turn for served in self.turn_adapters.values() for turn in served]
        if len(turns) != len(set(turns)):
            raise ValueError(f"turn_adapters {self.turn_adapters}: a turn is served by one adapter at most")
        if self.warmup.adapter and self.warmup.adapter not in self.turn_adapters:
            raise ValueError(f"warmup.adapter {self.warmup.adapter!r} serves no turn: name the turns it serves in "
                             f"turn_adapters: {{{self.warmup.adapter}: [own turns]}}")
        return self


