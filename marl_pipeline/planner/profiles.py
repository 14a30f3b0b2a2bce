"""Costs for GPUs no stored run has used: a roofline from the card's stated figures and the model's shape, the
trainer's share of the peak taken from a measured profile (``marl profile gpu``) where one exists.

A roofline is a bound, not a fit: each figure is the time the work takes at the stated peak (FLOP/s or memory
bandwidth) scaled by an efficiency, so a prediction from it is as good as those efficiencies. Its figures are
device-seconds: the simulation charges an engine replica's step, or a trainer's call, on the actor's device
(planner/simulate.py), and a replica's tensor-parallel devices or a trainer's workers are already divided into
them here.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from marl_pipeline.planner.costs import Costs, EngineCosts, TrainerCosts, Turn


@dataclass(frozen=True)
class GpuSpec:
    """A GPU's stated figures: dense bf16 matmul TFLOP/s (no sparsity), memory bandwidth in TB/s (10**12 bytes),
    memory in GiB."""

    name: str
    bf16_tflops: float
    bandwidth_tb_s: float
    memory_gib: float

    @property
    def flops(self) -> float:
        return self.bf16_tflops * 1e12

    @property
    def bandwidth(self) -> float:
        """Bytes a second."""
        return self.bandwidth_tb_s * 1e12


# NVIDIA's datasheets, SXM parts: "NVIDIA H100 Tensor Core GPU", "NVIDIA H200 Tensor Core GPU", "NVIDIA A100 Tensor
# Core GPU" (80GB); dense bf16 is the sheets' sparsity figure halved.
GPUS: dict[str, GpuSpec] = {
    "h100": GpuSpec("h100", bf16_tflops=989.0, bandwidth_tb_s=3.35, memory_gib=80.0),
    "h200": GpuSpec("h200", bf16_tflops=989.0, bandwidth_tb_s=4.8, memory_gib=141.0),
    "a100": GpuSpec("a100", bf16_tflops=312.0, bandwidth_tb_s=2.0, memory_gib=80.0),
}


def gpu(name: str) -> GpuSpec:
    """The stated figures of GPU ``name`` (case-insensitive, e.g. ``"h100"``).

    Raises:
        ValueError: ``name`` is not in :data:`GPUS`; the message lists the known ones.
    """
    spec = GPUS.get(name.strip().lower())
    if spec is None:
        raise ValueError(f"unknown GPU {name!r}: known ones are {', '.join(sorted(GPUS))}")
    return spec


_EXPERTS = ("num_local_experts", "num_experts", "n_routed_experts")


@dataclass(frozen=True)
class ModelShape:
    """What a roofline needs of a decoder-only transformer: its parameter count and the sizes its KV cache follows
    from. ``tied``: the output head is the input embedding (it counts once in ``parameters``)."""

    parameters: int
    layers: int
    hidden: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool = False

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """Bytes of KV cache one token takes: a key and a value of every layer's key/value heads."""
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes

    @classmethod
    def from_config(cls, config: str | Path | dict) -> ModelShape:
        """The shape of a Hugging Face ``config.json`` (a path to it or to its directory, or its dict).

        The parameters are estimated from the config, as a Llama-style dense decoder has them: per layer the query,
        key, value and output projections (``head_dim`` or ``hidden_size / num_attention_heads`` a head; biases on
        the query, key and value where ``attention_bias`` is set, or by default for ``model_type`` qwen2), a gated
        MLP (gate, up and down projections of ``intermediate_size``) and two norms; then a final norm, the
        embedding, and an output head of its own unless ``tie_word_embeddings``. A multimodal config's
        ``text_config`` is read when the top level has no ``hidden_size``.

        (``training/memory.py``'s ``architecture`` reads these keys from a loaded torch model, and counts no
        parameters, so it is not what a shape from a file on a machine without the model needs.)

        Raises:
            ValueError: the config lacks a key the shape needs, or is a mixture of experts (whose active
                parameters this estimate cannot tell).
        """
        where = "config"
        if not isinstance(config, dict):
            path = Path(config)
            path = path / "config.json" if path.is_dir() else path
            where = str(path)
            try:
                config = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError) as error:
                raise ValueError(f"{where}: not a readable JSON config ({error})") from error
            if not isinstance(config, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(config).__name__}")
        if "hidden_size" not in config and isinstance(config.get("text_config"), dict):
            config = config["text_config"]
        needed = ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size", "intermediate_size")
        missing = [key for key in needed if not config.get(key)]
        if missing:
            raise ValueError(f"{where} has no {', '.join(missing)}: a model shape needs {', '.join(needed)}")
        if any(config.get(key) for key in _EXPERTS):
            raise ValueError(f"{where} is a mixture of experts: its shape cannot be estimated as a dense model's")
        layers, hidden = config["num_hidden_layers"], config["hidden_size"]
        heads, vocab = config["num_attention_heads"], config["vocab_size"]
        head_dim = config.get("head_dim") or hidden // heads
        kv_heads = config.get("num_key_value_heads") or heads
        tied = bool(config.get("tie_word_embeddings", False))
        query, key_value = heads * head_dim, kv_heads * head_dim
        bias = config.get("attention_bias", config.get("model_type") == "qwen2")
        attention = 2 * hidden * query + 2 * hidden * key_value + ((query + 2 * key_value) if bias else 0)
        layer = attention + 3 * hidden * config["intermediate_size"] + 2 * hidden
        embedding = vocab * hidden
        parameters = layers * layer + hidden + embedding * (1 if tied else 2)
        return cls(parameters=parameters, layers=layers, hidden=hidden, kv_heads=kv_heads, head_dim=head_dim,
                   vocab=vocab, tied=tied)


def engine_roofline(shape: ModelShape, gpu: GpuSpec, tensor_parallel: int = 1, dtype_bytes: int = 2,
                    efficiency: float = 0.6, context_tokens: int = 1024) -> EngineCosts:
    """An engine replica's costs on ``tensor_parallel`` devices of ``gpu``, in device-seconds (seconds of the
    replica's step, charged on one thread).

    Assumptions:

    - a decode step reads every weight once (``parameters x dtype_bytes``), split evenly over the tensor-parallel
      devices, at ``efficiency`` of the stated bandwidth: the step's fixed part;
    - each decoding sequence adds the larger of reading its KV cache at ``context_tokens`` tokens of context (a
      typical length, not the sequence's own: the cost is linear in sequences, not in their lengths; the key/value
      heads split over at most ``kv_heads`` devices, vLLM replicating them beyond) and its ``2 x parameters``
      FLOPs at ``efficiency`` of the stated bf16 peak. The two parts add where a real step overlaps them, so a
      batch large enough to be compute-bound is charged the weights' read besides;
    - each prompt token admitted costs ``2 x parameters`` FLOPs at ``efficiency`` of the peak (prefill is
      compute-bound); attention's score FLOPs are left out of both;
    - no time between steps (scheduling, sampling, detokenization) and no communication between the
      tensor-parallel devices.

    Raises:
        ValueError: the weights do not fit in the replica's devices' memory, or an argument is not positive.
    """
    if tensor_parallel < 1 or dtype_bytes <= 0 or not 0 < efficiency <= 1 or context_tokens < 0:
        raise ValueError(f"engine_roofline: tensor_parallel {tensor_parallel} must be at least 1, dtype_bytes "
                         f"{dtype_bytes} positive, efficiency {efficiency} in (0, 1], context_tokens {context_tokens} "
                         f"not negative")
    weights = shape.parameters * dtype_bytes
    if weights / tensor_parallel > gpu.memory_gib * 2**30:
        raise ValueError(f"{shape.parameters:.3g} parameters at {dtype_bytes} bytes need "
                         f"{weights / tensor_parallel / 2**30:.1f} GiB a device at tensor parallel "
                         f"{tensor_parallel}: more than {gpu.name}'s {gpu.memory_gib:g} GiB")
    bandwidth = gpu.bandwidth * tensor_parallel * efficiency
    flops = gpu.flops * tensor_parallel * efficiency
    kv_shards = min(tensor_parallel, shape.kv_heads)
    kv_read = context_tokens * shape.kv_bytes_per_token(dtype_bytes) / (gpu.bandwidth * kv_shards * efficiency)
    compute = 2 * shape.parameters / flops
    return EngineCosts(step=weights / bandwidth, per_sequence=max(kv_read, compute), per_prompt_token=compute)


ADAM_BYTES = 28
"""Bytes a parameter the fused AdamW step moves in float32: it reads the weight, its gradient and the two moments
(16) and writes back the weight and the moments (12)."""


def trainer_roofline(shape: ModelShape, gpu: GpuSpec, workers: int = 1, mfu: float = 0.4, launch: float = 0.05,
                     link_gb_s: float = 25.0, sync_dtype_bytes: int = 4, commit: float = 0.0) -> TrainerCosts:
    """A trainer's costs on ``workers`` devices of ``gpu`` (sharded, the work split evenly), in device-seconds.

    Assumptions:

    - a token costs ``6 x parameters`` FLOPs (forward 2, backward 4: training/flops.py's count) at ``mfu`` of the
      stated bf16 peak of every worker together; ``mfu`` is a fraction of the stated peak (a measured one:
      :func:`trainer_profile`);
    - a call costs ``launch`` seconds beyond its tokens (kernel launches, the batch's transfer);
    - the optimizer step is memory-bound: :data:`ADAM_BYTES` a parameter at the full stated bandwidth, each worker
      stepping its shard;
    - a weight sync sends the trainer's float32 weights (``sync_dtype_bytes``) as its state dict has them, a tied
      embedding under both its names, to one engine replica at a time over a link of ``link_gb_s`` GB/s (NCCL
      over the node's network; a replica on the trainer's own node syncs faster);
    - the commit (the version's save and record) takes ``commit`` seconds.

    Raises:
        ValueError: ``workers`` is below 1, or ``mfu`` or ``link_gb_s`` not positive.
    """
    if workers < 1 or not 0 < mfu <= 1 or link_gb_s <= 0:
        raise ValueError(f"trainer_roofline: workers {workers} must be at least 1, mfu {mfu} in (0, 1], link_gb_s "
                         f"{link_gb_s} positive")
    sent = shape.parameters + (shape.vocab * shape.hidden if shape.tied else 0)
    return TrainerCosts(call=launch, per_token=6 * shape.parameters / (gpu.flops * workers * mfu),
                        apply=ADAM_BYTES * shape.parameters / (gpu.bandwidth * workers),
                        sync_per_replica=sent * sync_dtype_bytes / (link_gb_s * 1e9), commit=commit)


def trainer_profile(path: str | Path, *, model: str | None = None, variant: str = "default",
                    checkpointing: bool = False, gpu: GpuSpec | None = None) -> float:
    """A trainer's measured MFU as a fraction of its GPU's stated bf16 peak, for :func:`trainer_roofline`'s ``mfu``.

    Reads either ``marl profile gpu``'s output, as ``bench/engines/gpu_trainer.py --rl``'s (``peak_tflops``, ``gpu``
    and ``runs``, each run's ``mfu`` a fraction of the matmul peak measured in that process), or a plain
    ``{"mfu": ...}`` object, percent where above 1, else a fraction, of the stated peak (of the measured peak where
    the object has ``peak_tflops``). From a benchmark's runs, the one of ``variant`` and ``checkpointing`` (the
    trainer's defaults: the ``default`` variant, no activation checkpointing) and ``model`` (which may be left out where
    the file has one model).

    A measured peak is below the stated one, so its MFU is scaled by measured over stated to carry to another GPU:
    the stated peak is ``gpu``'s, or that of the table's GPU the file names (``NVIDIA H200``); PCIe and NVL parts,
    whose figures differ from the table's SXM ones, need ``gpu``.

    Raises:
        ValueError: the file is not JSON, has neither format, no run matches, several models do, or its GPU is not
            one of the table's; the message names the file and what is missing.
    """
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"trainer profile {path}: not a readable JSON file ({error})") from error
    if not isinstance(data, dict):
        raise ValueError(f"trainer profile {path}: expected a JSON object, got {type(data).__name__}")
    if "runs" in data:
        value = _benchmark_mfu(path, data, model, variant, checkpointing)
    elif "mfu" in data:
        value = _number(path, data["mfu"], "mfu")
        value = value / 100 if value > 1 else value
    else:
        raise ValueError(f"trainer profile {path} has neither 'runs' (marl profile gpu's output) nor "
                         f"'mfu' (percent or fraction)")
    if "peak_tflops" in data:
        measured = _number(path, data["peak_tflops"], "peak_tflops")
        value *= measured / (gpu or _named_gpu(path, data.get("gpu"))).bf16_tflops
    if not 0 < value <= 1:
        raise ValueError(f"trainer profile {path}: MFU {value:.4g} of the stated peak is not in (0, 1]")
    return value


def _number(path: Path, value, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"trainer profile {path}: {key!r} is {value!r}, not a positive number")
    return float(value)


def _benchmark_mfu(path: Path, data: dict, model: str | None, variant: str, checkpointing: bool) -> float:
    runs = data["runs"]
    if not isinstance(runs, list):
        raise ValueError(f"trainer profile {path}: 'runs' is a {type(runs).__name__}, not a list of runs")
    if "peak_tflops" not in data:
        raise ValueError(f"trainer profile {path} has runs but no 'peak_tflops', the measured peak their MFU is of")
    runs = [run for run in runs if isinstance(run, dict)]
    chosen = [run for run in runs if run.get("variant") == variant and run.get("checkpointing") == checkpointing
              and (model is None or run.get("model") == model) and "mfu" in run and "error" not in run]
    if not chosen:
        present = sorted({(str(run.get("model")), str(run.get("variant")), str(run.get("checkpointing")),
                           "ok" if "mfu" in run and "error" not in run else "no mfu") for run in runs})
        raise ValueError(f"trainer profile {path} has no run with an 'mfu' of model {model or 'any'}, variant "
                         f"{variant!r}, checkpointing {checkpointing}; its runs (model, variant, checkpointing): "
                         f"{present or 'none'}")
    models = sorted({str(run.get("model")) for run in chosen})
    if len(models) > 1:
        raise ValueError(f"trainer profile {path} has runs of several models ({', '.join(models)}): choose one with "
                         f"model=")
    return sum(_number(path, run["mfu"], "mfu") for run in chosen) / len(chosen)


def _named_gpu(path: Path, name) -> GpuSpec:
    text = str(name or "").lower()
    matches = [spec for key, spec in GPUS.items() if key in text]
    if len(matches) != 1 or "pcie" in text or "nvl" in text:
        raise ValueError(f"trainer profile {path}: its GPU {name!r} is not one of {', '.join(sorted(GPUS))} (SXM): "
                         f"pass gpu= for the stated peak its measured MFU is scaled to")
    return matches[0]


def gpu_costs(agents: dict[str, ModelShape], gpu: GpuSpec, tensor_parallel: dict[str, int],
              workers: dict[str, int], episodes: list[list[Turn]], mfu: float | dict[str, float] | None = None,
              source_note: str = "", *, environment: float = 0.0, reward: float = 0.0, rollout_overhead: float = 0.0,
              train_overhead: float = 0.0, handoff: float = 0.0, context_tokens: int = 1024) -> Costs:
    """Every agent's engine and trainer costs on ``gpu`` from rooflines (:func:`engine_roofline`,
    :func:`trainer_roofline` at their other defaults), for the simulation to replay ``episodes`` with.

    Args:
        agents: each agent's model shape.
        gpu: the GPU every engine replica and trainer worker runs on.
        tensor_parallel: each agent's engine replica's devices (1 for an agent left out).
        workers: each agent's trainer workers (1 for an agent left out).
        episodes: the workload, each episode its turns in order (e.g. a stored run's ``Costs.episodes``).
        mfu: the trainers' MFU, one for all or one an agent (a fraction of the stated peak, e.g.
            :func:`trainer_profile`'s); None: ``trainer_roofline``'s default, and the costs' source says
            ``roofline on <gpu>``, else ``trainer profile <source_note>``.
        source_note: where a given ``mfu`` comes from (a profile's path).
        environment: the environment stage's seconds a micro-batch, on the driver.
        reward: the reward stage's seconds a micro-batch.
        rollout_overhead: a rollout micro-batch's seconds beyond its turns.
        train_overhead: a training micro-batch's seconds beyond its trainers' calls.
        handoff: a micro-batch's seconds from one stage to the next (``Costs.handoff``).
        context_tokens: the engines' typical context (:func:`engine_roofline`).

    Raises:
        ValueError: an episode's turn is an agent with no shape, or a dict ``mfu`` leaves an agent out.
    """
    unknown = sorted({turn.agent for episode in episodes for turn in episode} - set(agents))
    if unknown:
        raise ValueError(f"the episodes have turns of {', '.join(unknown)}, which have no model shape")
    if isinstance(mfu, dict) and set(agents) - set(mfu):
        raise ValueError(f"mfu has no figure for {', '.join(sorted(set(agents) - set(mfu)))}")
    trainers = {}
    for agent, shape in agents.items():
        share = mfu.get(agent) if isinstance(mfu, dict) else mfu
        options = {} if share is None else {"mfu": share}
        trainers[agent] = trainer_roofline(shape, gpu, workers=workers.get(agent, 1), **options)
    engines = {agent: engine_roofline(shape, gpu, tensor_parallel=tensor_parallel.get(agent, 1),
                                      context_tokens=context_tokens) for agent, shape in agents.items()}
    if mfu is None:
        source = f"roofline on {gpu.name}"
    else:
        shares = (", ".join(f"{agent} {share:.1%}" for agent, share in sorted(mfu.items()))
                  if isinstance(mfu, dict) else f"{mfu:.1%}")
        source = f"trainer profile {source_note or 'given'} (MFU {shares}), roofline on {gpu.name}"
    return Costs(engines=engines, trainers=trainers, environment=environment, reward=reward,
                 rollout_overhead=rollout_overhead, train_overhead=train_overhead, handoff=handoff,
                 episodes=list(episodes), source=source)
