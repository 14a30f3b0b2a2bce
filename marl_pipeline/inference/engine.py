"""Rollout engine: one vLLM ``LLM`` per agent replica, living in-process inside a Ray actor.

The engine never restarts during a run: :meth:`RolloutEngine.load_weights` reloads new parameters in
place (vLLM's ``reload_weights``, which also handles weights the CPU backend re-packed at load time)
and drops the prefix cache, so the next request samples from the new policy version.
"""

from __future__ import annotations

import gc
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from marl_pipeline.policy.checkpoint import RECORD_FILES

# The engine must stay in the actor's process: weights are then reloaded by reference, not pickled
# to an engine-core subprocess. Set before vllm is imported anywhere in this process.
# TORCHDYNAMO_DISABLE: the engine runs eager (``enforce_eager``), yet vLLM's sampler torch.compiles a token-rank count
# on its first call with log-probabilities: seconds of each engine's start-up, for a count eager torch does exactly.
ENGINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
              "TOKENIZERS_PARALLELISM": "false", "VLLM_LOGGING_LEVEL": "WARNING", "TORCHDYNAMO_DISABLE": "1"}


def set_engine_threads(threads: int) -> None:
    """The CPU threads of this process's vLLM engine; call before the engine is built. vLLM's CPU worker with
    ``nobind`` keeps the process's torch thread count and then makes ``torch.set_num_threads`` a no-op, and a
    Ray actor with fractional ``num_cpus`` starts with ``OMP_NUM_THREADS=1``: without this the engine decodes on
    one core. ``OMP_NUM_THREADS`` is set too, because vLLM reads it for its own thread settings."""
    import torch

    if threads < 1:
        raise ValueError(f"engine threads {threads}: expected at least 1")
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)


MAX_NUM_SEQS = 256
"""Requests an engine runs at once (vLLM's default); more queue inside the engine."""
WARMUP_BATCHES = (1,)
"""Batch sizes of two-token requests an engine samples once built, paying its one-off first-call costs. With
dynamo off (``ENGINE_ENV``) only the first call has any: a first 256-request batch takes as long as the next, so
larger warm-up batches (which warmed a compiled sampler's shapes) would only lengthen start-up."""


def engine_dtype(dtype: str) -> str:
    """The engine's dtype for vLLM: ``auto`` is resolved here, by the same hardware check as the trainer's, because
    vLLM's own ``auto`` picks bf16 for a float32 checkpoint on any x86 CPU, emulated and slow where the CPU lacks
    AMX/AVX512-BF16, and then the engine and the trainer would disagree."""
    if dtype != "auto":
        return dtype
    import torch

    from marl_pipeline.policy.precision import resolve_dtype

    return "bfloat16" if resolve_dtype("auto", engine_device()) == torch.bfloat16 else "float32"


def kv_cache_bytes(model_dir: str, *, max_model_len: int, dtype: str, gpu_memory_utilization: float,
                   kv_cache_gib: float | None) -> int | None:
    """The engine's KV cache in bytes (vLLM's ``kv_cache_memory_bytes``; None: vLLM sizes it by the memory share).

    ``kv_cache_gib`` when set. Else, on a CPU, room for ``MAX_NUM_SEQS`` sequences at full length twice over (the
    second for the prefix cache), where the memory share would give more: vLLM zeroes its whole cache at start, so
    a share sized for a large model costs a small one seconds of each start-up for memory it never uses. A GPU's
    cache stays its share (allocation costs nothing there; what is not needed serves longer prefixes)."""
    if kv_cache_gib is not None:
        return int(kv_cache_gib * 2**30)
    if engine_device() != "cpu":
        return None
    from marl_pipeline.policy.checkpoint import kv_cache_bytes_per_token

    element = 4 if engine_dtype(dtype) == "float32" else 2
    need = 2 * MAX_NUM_SEQS * max_model_len * kv_cache_bytes_per_token(model_dir, element)
    weights = sum(path.stat().st_size for path in Path(model_dir).glob("*.safetensors"))
    share = gpu_memory_utilization * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") - weights
    return need if need < share else None


def engine_device() -> str:
    """Where this process's vLLM engine computes: ``cuda`` where torch sees a GPU, else ``cpu``."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass(frozen=True)
class GenerationRequest:
    """One completion to sample: what crosses the engine boundary (rollout, evaluation, benchmarks)."""

    prompt: str | list[int]
    """Text (vLLM tokenizes it with the model's tokenizer) or token ids, sent as they are (a chat prompt the driver
    tokenized: inference/chat.py)."""
    seed: int
    max_tokens: int
    temperature: float
    adapter: str | None = None
    """The named adapter of the agent's version 0 that serves it over the policy's weights (policy/lora.py)."""
    ignore_eos: bool = False
    """Sample exactly ``max_tokens`` tokens (benchmarks that set response lengths)."""


@dataclass(frozen=True)
class Completion:
    """One sampled completion, produced by the engine and consumed by the rollout stage."""

    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str
    engine_seconds: float | None = None
    """Its share of the engine steps that computed it (each step's time split evenly over its requests): the
    asynchronous engine's; None: not measured (the batched engine)."""


class PromptTooLong(ValueError):
    """A prompt the engine's context (``max_model_len``) cannot hold, as vLLM refused it: its request fails alone,
    and the rollout ends the episode there, failed (stages/trajectories.py), where the launch used to stop."""


def refused_prompt(request_id: str, error: Exception) -> Exception:
    """What a request vLLM refused fails with: :class:`PromptTooLong` where its prompt left no room for an output
    token (vLLM 0.32's two ``VLLMValidationError``s: over ``max_model_len``, or exactly at it)."""
    text = str(error)
    if type(error).__name__ == "VLLMValidationError" and ("maximum context length" in text
                                                           or "maximum model length" in text):
        return PromptTooLong(f"request {request_id!r}: {text}")
    return error


class RolloutEngine:
    """A vLLM engine serving one agent's policy; construct inside a Ray actor (or a ``__main__`` script)."""

    def __init__(self, model_dir: str, version: int, *, gpu_memory_utilization: float, max_model_len: int,
                 dtype: str, seed: int, threads: int | None = None, adapter_dir: str | None = None,
                 kv_cache_gib: float | None = None, tensor_parallel_size: int = 1, sleep_mode: bool = False) -> None:
        """``model_dir`` is a full model; with ``adapter_dir`` (a LoRA agent's version after 0, policy/lora.py)
        ``model_dir`` is that agent's base and the engine serves the base with the adapters merged in. ``sleep_mode``:
        it gives its GPUs to its agent's trainer between rollouts (cluster/colocation.py)."""
        os.environ.update(ENGINE_ENV)
        if threads is not None:
            set_engine_threads(threads)
        from vllm import LLM, SamplingParams

        # The imports' objects live as long as the process: frozen, vLLM's full collections while it loads the
        # model skip them, as its own freeze after start-up would.
        gc.freeze()
        self._sampling_params = SamplingParams
        # Version 0's named adapters (policy/lora.py): served by vLLM's LoRA on the requests that name them, over the
        # merged RL weights every request gets (reload_weights works with LoRA enabled).
        self._adapters = named_lora_requests(model_dir)
        lora = {} if not self._adapters else {
            "enable_lora": True, "max_loras": len(self._adapters),
            "max_lora_rank": max(lora_rank_bound(request.lora_path) for request in self._adapters.values())}
        if lora and engine_device() == "cpu":
            from marl_pipeline.inference.cpu_lora_ops import install

            # vLLM's own CPU LoRA ops copy every token's adapter weights, and give a request without an adapter
            # the last slot's (inference/cpu_lora_ops.py).
            install()
        # vLLM frees GPU memory on sleep with its own allocator and refuses sleep mode on a CPU, where the turns
        # pause its scheduler alone (sleep level 0)
        self.sleep_level = 1 if sleep_mode and engine_device() == "cuda" else 0
        self.llm = LLM(model=model_dir, **lora, dtype=engine_dtype(dtype),
                       gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len,
                       enforce_eager=True, seed=seed, max_num_seqs=MAX_NUM_SEQS,
                       enable_sleep_mode=self.sleep_level == 1,
                       # Over several GPUs: vLLM's Ray workers, in the placement group this actor runs in (spawn.py)
                       tensor_parallel_size=tensor_parallel_size,
                       distributed_executor_backend="ray" if tensor_parallel_size > 1 else None,
                       # vLLM 0.32's CPU sampler fails ("CPU Generator does not use offset") when a seeded
                       # request's prompt is prefilled in chunks, which happens once a batch's prompt tokens pass
                       # max_num_batched_tokens (4096 by default): with room for every sequence at full length,
                       # no prompt is ever chunked (reproduced with 200 requests of 60 tokens: fails, then passes).
                       max_num_batched_tokens=MAX_NUM_SEQS * max_model_len,
                       kv_cache_memory_bytes=kv_cache_bytes(
                           model_dir, max_model_len=max_model_len, dtype=dtype,
                           gpu_memory_utilization=gpu_memory_utilization, kv_cache_gib=kv_cache_gib))
        self.version = version
        self.model_dir = model_dir
        # What a restart must match to reuse this engine (cluster/warm_actors.py).
        self._settings = dict(gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len,
                              dtype=dtype, seed=seed, threads=threads, kv_cache_gib=kv_cache_gib,
                              tensor_parallel_size=tensor_parallel_size, sleep_mode=sleep_mode)
        self._fingerprint = model_fingerprint(model_dir)
        if adapter_dir is not None:
            from marl_pipeline.policy.lora import merged_checkpoint

            self.load_weights(merged_checkpoint(model_dir, adapter_dir), version)
        # The first call pays one-off set-up costs: now, not in step 0. Two tokens take it through a prefill and a
        # decode step; more only lengthen start-up.
        for batch in WARMUP_BATCHES:
            self.generate([GenerationRequest("warm-up", seed, max_tokens=2, temperature=1.0) for seed in range(batch)])

    def generate(self, requests: list[GenerationRequest]) -> tuple[int, list[Completion]]:
        """Sample one completion per request, each with its own seed, so sampling is reproducible;
        ``Completion.prompt_ids`` are the ids the engine sampled from. Returns the policy version that produced the
        completions, and the completions."""
        prompts = [engine_prompt(f"prompt {i}", request.prompt) for i, request in enumerate(requests)]
        outputs = self.llm.generate(prompts, [self.sampling_params(request) for request in requests], use_tqdm=False,
                                    lora_request=[self.lora_request(request.adapter) for request in requests]
                                    if any(request.adapter for request in requests) else None)
        return self.version, [completion_of(output) for output in outputs]

    def sampling_params(self, request: GenerationRequest):
        """vLLM's ``SamplingParams`` of a request; ``logprobs=0`` returns exactly the sampled token's logprob."""
        return self._sampling_params(max_tokens=request.max_tokens, temperature=request.temperature,
                                     seed=request.seed, logprobs=0, ignore_eos=request.ignore_eos)

    def lora_request(self, adapter: str | None):
        """vLLM's ``LoRARequest`` of a named adapter (None: the policy's merged weights alone)."""
        if adapter is None:
            return None
        if adapter not in self._adapters:
            raise ValueError(f"adapter {adapter!r}: the engine's version 0 ({self.model_dir}) has "
                             f"{sorted(self._adapters) or 'no named adapters'}")
        return self._adapters[adapter]

    def completion_logprobs(self, prompt_ids: list[int], response_ids: list[int],
                            adapter: str | None = None) -> list[float]:
        """The engine's logprob of each response token given the prompt (teacher forcing), with ``adapter``."""
        ids = list(prompt_ids) + list(response_ids)
        params = self._sampling_params(max_tokens=1, prompt_logprobs=0, temperature=1.0)
        output = self.llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False,
                                   lora_request=self.lora_request(adapter))[0]
        return [output.prompt_logprobs[i][ids[i]].logprob for i in range(len(prompt_ids), len(ids))]

    def model_directory(self) -> str:
        """The directory the engine loaded (the agent's policy at its first version, or a LoRA agent's base), on the
        engine's node."""
        return self.model_dir

    def tokenizer(self):
        """The agent's Hugging Face tokenizer (no policy version changes it), for a driver that may run on another
        node than the directory it is read from."""
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.model_dir)

    def load_weights(self, named_tensors: list[tuple[str, object]], version: int) -> int:
        """Replace the served parameters in place with a new policy version's."""
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(named_tensors)})
        self.llm.reset_prefix_cache()
        self.version = version
        return version

    def policy_version(self) -> int:
        return self.version

    def restart(self, model_dir: str, version: int, *, adapter_dir: str | None = None, **settings) -> bool:
        """Serve ``version`` as an engine built with these arguments would (a kept actor taken by a new launch:
        cluster/warm_actors.py): by reloading its weights into the model held, or, for other settings or another
        model (its files besides the weights), by building that engine here in place of this one
        (:meth:`rebuild`). False, with nothing changed, where it cannot be built in this process
        (:meth:`rebuildable`)."""
        weights = self.restart_weights(model_dir, adapter_dir, settings)
        if weights is not None:
            self.load_weights(weights, version)
            self.model_dir = model_dir
            return True
        if not self.rebuildable(settings):
            return False
        self.rebuild(model_dir, version, adapter_dir=adapter_dir, **settings)
        return True

    def rebuildable(self, settings: dict) -> bool:
        """Whether an engine with these settings can be built in this process in place of this one: on a CPU, with
        one rank and this engine's threads (vLLM's CPU worker binds its threads once per process). A kept actor that
        is not is replaced by a new one."""
        return (engine_device() == "cpu" and settings.get("threads") == self._settings["threads"]
                and settings.get("tensor_parallel_size", 1) == self._settings["tensor_parallel_size"] == 1)

    def rebuild(self, model_dir: str, version: int, **settings) -> None:
        """Free this process's vLLM engine and build another from these arguments, as a new actor would, without a
        new process's imports. vLLM's own tests build engine after engine in one process this way."""
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        # The build froze what was alive then, this engine included: unfrozen, it is collected now, its finalizers
        # run before the next engine sets vLLM's process state up again, not at a later collection after it.
        gc.unfreeze()
        del self.llm
        gc.collect()
        cleanup_dist_env_and_memory()
        self.__init__(model_dir, version, **settings)

    def restart_weights(self, model_dir: str, adapter_dir: str | None, settings: dict) -> list | None:
        """The weights :meth:`restart` reloads, or None where this engine cannot serve ``model_dir``."""
        if settings != self._settings or model_fingerprint(model_dir) != self._fingerprint:
            return None
        if self._adapters or named_lora_requests(model_dir):
            return None  # named adapters are the run's own: a new engine loads them
        if adapter_dir is not None:
            from marl_pipeline.policy.lora import merged_checkpoint

            return merged_checkpoint(model_dir, adapter_dir)
        return checkpoint_weights(model_dir)


def completion_of(output) -> Completion:
    """One vLLM ``RequestOutput`` (sampled with ``logprobs=0``) as a :class:`Completion`."""
    sample = output.outputs[0]
    logprobs = [entry[token].logprob for token, entry in zip(sample.token_ids, sample.logprobs)]
    return Completion(list(output.prompt_token_ids), list(sample.token_ids), logprobs, sample.text,
                      str(sample.finish_reason))


def named_lora_requests(model_dir: str) -> dict:
    """vLLM's ``LoRARequest`` of each named adapter of an agent's version 0 (``model_dir``), by name."""
    from marl_pipeline.policy.lora import named_adapter_dirs

    adapters = named_adapter_dirs(model_dir)
    if not adapters:
        return {}
    from vllm.lora.request import LoRARequest

    return {name: LoRARequest(name, number, str(directory))
            for number, (name, directory) in enumerate(adapters.items(), start=1)}


def lora_rank_bound(adapter_dir: str) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds the adapters' rank."""
    import json

    rank = json.loads((Path(adapter_dir) / "adapter_config.json").read_text())["r"]
    bound = next((bound for bound in (1, 8, 16, 32, 64, 128, 256, 320, 512) if bound >= rank), None)
    if bound is None:
        raise ValueError(f"{adapter_dir}: adapters of rank {rank}; vLLM serves LoRA ranks up to 512")
    return bound


# Files of a policy directory that are not the model's definition: its weights and the store's records (the trainer's
# state among them). Everything else (config, generation config, tokenizer, chat template) shapes the engine.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def model_fingerprint(model_dir: str) -> str:
    """A hash of the files an engine is built from besides the weights: two directories with the same fingerprint
    are served by one engine with the other's weights reloaded."""
    digest = hashlib.sha256()
    for path in sorted(Path(model_dir).iterdir()):
        if (path.is_file() and not path.name.endswith(_WEIGHT_SUFFIXES) and path.name not in RECORD_FILES
                and not path.name.startswith(("_", "."))):
            digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def checkpoint_weights(model_dir: str) -> list | None:
    """A full checkpoint's tensors by name (its safetensors files), as vLLM's ``reload_weights`` takes them; None
    for a checkpoint in another format."""
    from safetensors.torch import load_file

    files = sorted(Path(model_dir).glob("*.safetensors"))
    return [item for file in files for item in load_file(file).items()] if files else None


def engine_prompt(where: str, prompt: object) -> str | dict[str, list[int]]:
    """A prompt as vLLM takes it; token ids must be a non-empty list of ints (checked here, where the request is
    still known, ``where``, rather than deep inside vLLM)."""
    if isinstance(prompt, str):
        return prompt
    if not isinstance(prompt, list) or not prompt or not all(type(token) is int for token in prompt):
        raise TypeError(f"{where}: expected a str or a non-empty list of int token ids, got {prompt!r:.80}")
    return {"prompt_token_ids": prompt}
