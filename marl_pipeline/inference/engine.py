"""Rollout engine: one vLLM ``LLM`` per agent replica, living in-process inside a Ray actor.

The engine never restarts during a run: :meth:`RolloutEngine.load_weights` reloads new parameters in
place (vLLM's ``reload_weights``, which also handles weights the CPU backend re-packed at load time)
and drops the prefix cache, so the next request samples from the new policy version.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

# The engine must stay in the actor's process: weights are then reloaded by reference, not pickled
# to an engine-core subprocess. Set before vllm is imported anywhere in this process.
ENGINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
              "TOKENIZERS_PARALLELISM": "false", "VLLM_LOGGING_LEVEL": "WARNING"}


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


def engine_dtype(dtype: str) -> str:
    """The engine's dtype for vLLM: ``auto`` is resolved here, by the same hardware check as the trainer's, because
    vLLM's own ``auto`` picks bf16 for a float32 checkpoint on any x86 CPU, emulated and slow where the CPU lacks
    AMX/AVX512-BF16, and then the engine and the trainer would disagree."""
    if dtype != "auto":
        return dtype
    import torch

    from marl_pipeline.policy.precision import resolve_dtype

    return "bfloat16" if resolve_dtype("auto", engine_device()) == torch.bfloat16 else "float32"


def engine_device() -> str:
    """Where this process's vLLM engine computes: ``cuda`` where torch sees a GPU, else ``cpu``."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass(frozen=True)
class Completion:
    """One sampled completion, produced by the engine and consumed by the rollout stage."""

    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str


class RolloutEngine:
    """A vLLM engine serving one agent's policy; construct inside a Ray actor (or a ``__main__`` script)."""

    def __init__(self, model_dir: str, version: int, *, gpu_memory_utilization: float, max_model_len: int,
                 dtype: str, seed: int, threads: int | None = None, adapter_dir: str | None = None,
                 kv_cache_gib: float | None = None) -> None:
        """``model_dir`` is a full model; with ``adapter_dir`` (a LoRA agent's version after 0, policy/lora.py)
        ``model_dir`` is that agent's base and the engine serves the base with the adapters merged in."""
        os.environ.update(ENGINE_ENV)
        if threads is not None:
            set_engine_threads(threads)
        from vllm import LLM, SamplingParams

        self._sampling_params = SamplingParams
        # A warm-up kept apart (policy/lora.py): its adapters served by vLLM's LoRA on the taught turns' requests
        # only, over the merged RL weights every request gets (reload_weights works with LoRA enabled).
        self._taught = warmup_lora_request(model_dir)
        lora = {} if self._taught is None else {"enable_lora": True, "max_loras": 1,
                                                "max_lora_rank": lora_rank_bound(self._taught.lora_path)}
        if lora and engine_device() == "cpu":
            from marl_pipeline.inference.cpu_lora_ops import install

            # vLLM's own CPU LoRA ops copy every token's adapter weights, and give a request without an adapter
            # the last slot's, here the warm-up's (inference/cpu_lora_ops.py).
            install()
        self.llm = LLM(model=model_dir, **lora, dtype=engine_dtype(dtype),
                       gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len,
                       enforce_eager=True, seed=seed, max_num_seqs=MAX_NUM_SEQS,
                       # vLLM 0.32's CPU sampler fails ("CPU Generator does not use offset") when a seeded
                       # request's prompt is prefilled in chunks, which happens once a batch's prompt tokens pass
                       # max_num_batched_tokens (4096 by default): with room for every sequence at full length,
                       # no prompt is ever chunked (reproduced with 200 requests of 60 tokens: fails, then passes).
                       max_num_batched_tokens=MAX_NUM_SEQS * max_model_len,
                       kv_cache_memory_bytes=None if kv_cache_gib is None else int(kv_cache_gib * 2**30))
        self.version = version
        self.model_dir = model_dir
        # What a restart must match to reuse this engine (cluster/warm_actors.py).
        self._settings = dict(gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len,
                              dtype=dtype, seed=seed, threads=threads, kv_cache_gib=kv_cache_gib)
        self._fingerprint = model_fingerprint(model_dir)
        if adapter_dir is not None:
            from marl_pipeline.policy.lora import merged_checkpoint

            self.load_weights(merged_checkpoint(model_dir, adapter_dir), version)
        # The first calls pay one-off set-up costs for each batch shape and sampling path (4 s on CPU for a
        # first 128-request batch, measured by bench/pipeline.py): pay them now, not in step 0. Two tokens take
        # each batch through a prefill and a decode step; eight took SmolLM2 15 s more here, for nothing.
        for batch in (1, 16, 256):
            self.generate(["warm-up"] * batch, list(range(batch)), max_tokens=2, temperature=1.0)

    def generate(self, prompts: list[str | list[int]], seeds: list[int], max_tokens: int,
                 temperature: float, taught: list[bool] | None = None) -> tuple[int, list[Completion]]:
        """Sample one completion per prompt; each request has its own seed, so sampling is reproducible.

        A prompt is text (vLLM tokenizes it with the model's tokenizer) or token ids, sent as they are
        (``prompt_token_ids``: a chat prompt tokenized by the driver, inference/chat.py); either way
        ``Completion.prompt_ids`` are the ids the engine sampled from.
        ``taught`` marks the prompts of turns a separate warm-up taught (served with its adapters, where the
        engine has them). Returns the policy version that produced the completions, and the completions.
        """
        params = [self._sampling_params(max_tokens=max_tokens, temperature=temperature, seed=seed, logprobs=0)
                  for seed in seeds]
        outputs = self.llm.generate([_engine_prompt(i, prompt) for i, prompt in enumerate(prompts)], params,
                                    use_tqdm=False, lora_request=self.lora_requests(taught, len(prompts)))
        completions = []
        for output in outputs:
            sample = output.outputs[0]
            # logprobs=0 returns exactly the sampled token's logprob at each position.
            logprobs = [entry[token].logprob for token, entry in zip(sample.token_ids, sample.logprobs)]
            completions.append(Completion(list(output.prompt_token_ids), list(sample.token_ids), logprobs,
                                          sample.text, str(sample.finish_reason)))
        return self.version, completions

    def lora_requests(self, taught: list[bool] | None, count: int) -> list | None:
        """vLLM's ``lora_request`` for ``count`` prompts: the warm-up's adapters where ``taught`` (None: none)."""
        if taught is None or self._taught is None:
            return None
        if len(taught) != count:
            raise ValueError(f"{count} prompts but {len(taught)} taught flags: one per prompt")
        return [self._taught if flag else None for flag in taught]

    def taught_request(self, taught: bool):
        """The ``LoRARequest`` of one request (None: the merged weights alone)."""
        return self._taught if taught else None

    def completion_logprobs(self, prompt_ids: list[int], response_ids: list[int], taught: bool = False) -> list[float]:
        """The engine's logprob of each response token given the prompt (teacher forcing); ``taught`` as in
        :meth:`generate`."""
        ids = list(prompt_ids) + list(response_ids)
        params = self._sampling_params(max_tokens=1, prompt_logprobs=0, temperature=1.0)
        output = self.llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False,
                                   lora_request=self.taught_request(taught))[0]
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
        """Serve ``version`` as an engine built with these arguments would, by reloading its weights into the model
        held (a kept actor taken by a new launch: cluster/warm_actors.py). False, with nothing changed, where these
        arguments would build another engine: other settings, or another model (its files besides the weights)."""
        weights = self.restart_weights(model_dir, adapter_dir, settings)
        if weights is None:
            return False
        self.load_weights(weights, version)
        self.model_dir = model_dir
        return True

    def restart_weights(self, model_dir: str, adapter_dir: str | None, settings: dict) -> list | None:
        """The weights :meth:`restart` reloads, or None where this engine cannot serve ``model_dir``."""
        if settings != self._settings or model_fingerprint(model_dir) != self._fingerprint:
            return None
        if self._taught is not None or warmup_lora_request(model_dir) is not None:
            return None  # the warm-up's adapters are the run's own: a new engine loads them
        if adapter_dir is not None:
            from marl_pipeline.policy.lora import merged_checkpoint

            return merged_checkpoint(model_dir, adapter_dir)
        return checkpoint_weights(model_dir)


def warmup_lora_request(model_dir: str):
    """vLLM's ``LoRARequest`` for the separate warm-up adapters of an agent's version 0 (``model_dir``), or None."""
    from marl_pipeline.policy.lora import warmup_adapter_dir

    directory = warmup_adapter_dir(model_dir)
    if directory is None:
        return None
    from vllm.lora.request import LoRARequest

    return LoRARequest("warmup", 1, str(directory))


def lora_rank_bound(adapter_dir: str) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds the adapters' rank."""
    import json

    rank = json.loads((Path(adapter_dir) / "adapter_config.json").read_text())["r"]
    bound = next((bound for bound in (1, 8, 16, 32, 64, 128, 256, 320, 512) if bound >= rank), None)
    if bound is None:
        raise ValueError(f"{adapter_dir}: adapters of rank {rank}; vLLM serves LoRA ranks up to 512")
    return bound


# Files of a policy directory that are not the model's definition: its weights, the trainer's state, the store's
# records. Everything else (config, generation config, tokenizer, chat template) shapes the engine vLLM builds.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_RECORD_FILES = ("timing.json",)


def model_fingerprint(model_dir: str) -> str:
    """A hash of the files an engine is built from besides the weights: two directories with the same fingerprint
    are served by one engine with the other's weights reloaded."""
    digest = hashlib.sha256()
    for path in sorted(Path(model_dir).iterdir()):
        if (path.is_file() and not path.name.endswith(_WEIGHT_SUFFIXES) and path.name not in _RECORD_FILES
                and not path.name.startswith(("_", "."))):
            digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def checkpoint_weights(model_dir: str) -> list | None:
    """A full checkpoint's tensors by name (its safetensors files), as vLLM's ``reload_weights`` takes them; None
    for a checkpoint in another format."""
    from safetensors.torch import load_file

    files = sorted(Path(model_dir).glob("*.safetensors"))
    return [item for file in files for item in load_file(file).items()] if files else None


def _engine_prompt(index: int, prompt: str | list[int]) -> str | dict[str, list[int]]:
    """One prompt as vLLM takes it; token ids must be a non-empty list of ints (checked here, where the
    request is still known by its index, rather than deep inside vLLM)."""
    if isinstance(prompt, str):
        return prompt
    if not isinstance(prompt, list) or not prompt or not all(type(token) is int for token in prompt):
        raise TypeError(f"prompt {index}: expected a str or a non-empty list of int token ids, got {prompt!r:.80}")
    return {"prompt_token_ids": prompt}
