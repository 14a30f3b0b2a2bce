"""Experiment config: one YAML file, loaded into typed, validated objects before anything runs.

Unknown keys are errors everywhere (``extra="forbid"``); cross-field checks (agents against the
environment's roles) run in :func:`load_config` so a bad file fails before the store is touched.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

BUILTIN_TINY = "builtin:tiny"
"""The built-in tiny model (built locally, no download): the default of every model field."""


class ConfigError(ValueError):
    """A config file is invalid; the message names the offending field."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class EngineConfig(_Strict):
    """Rollout engine (vLLM) settings for one agent."""

    gpu_memory_utilization: float = Field(0.15, gt=0, le=1)
    """Share of device memory for weights + KV cache; on CPU a share of NUMA node 0's memory."""
    max_model_len: int = Field(256, ge=16)
    """Longest prompt + completion the engine accepts, in tokens."""
    dtype: str = "float32"
    """Engine dtype; float32 keeps the engine's logprobs comparable with the trainer's."""
    num_cpus: float = Field(0.5, ge=0)
    """Ray CPUs reserved for the engine actor."""
    num_gpus: float = Field(0.0, ge=0)
    """Ray GPUs reserved for the engine actor (0 on CPU machines)."""


class TrainerConfig(_Strict):
    """Torch trainer settings for one agent."""

    lr: float = Field(1e-3, gt=0)
    """AdamW learning rate (peak, before decay)."""
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
    dtype: Literal["float32", "bfloat16", "auto"] = "float32"
    """Trainer precision: ``bfloat16`` runs forward and backward under bf16 autocast with float32 master weights
    and optimizer state; ``auto`` is bfloat16 where the hardware has it (CPU with AMX or AVX512-BF16, CUDA with
    bf16 support), float32 elsewhere."""


class WarmupConfig(_Strict):
    """Supervised warm-up of the base policy (version 0), before any RL step."""

    steps: int = Field(150, ge=0)
    """Optimizer steps of warm-up; 0 uses the model as loaded."""
    batch_size: int = Field(32, ge=1)
    """Examples per warm-up step."""
    lr: float = Field(3e-3, gt=0)
    """Warm-up learning rate."""


class AgentConfig(_Strict):
    """One role of the workflow, with its own policy."""

    model: str = BUILTIN_TINY
    """``builtin:tiny`` (built locally), a local Hugging Face model directory, a hub id, a ``.gguf`` file
    (dequantized once into a cached directory), or a packaged model's short name (``smollm2-135m-instruct``,
    the ``models`` extra); see ``runtime/model_sources.py``."""
    engine: EngineConfig = EngineConfig()
    trainer: TrainerConfig = TrainerConfig()
    warmup: WarmupConfig = WarmupConfig()


class PoolSettings(_Strict):
    """The action pool's size, limits and retries (``environment.pool``, or a plugin's ``pool_settings``)."""

    min_workers: int = Field(1, ge=1)
    """Workers kept alive while the pool exists."""
    max_workers: int = Field(4, ge=1)
    """Most workers at once, reached when the queue is long."""
    actions_per_worker: int = Field(4, ge=1)
    """Queued or running actions per worker the pool aims for when it sizes itself."""
    timeout_s: float = Field(30.0, gt=0)
    """Per-action wall-clock limit; the worker running it is killed when it passes."""
    retries: int = Field(1, ge=0)
    """Extra attempts for an action that timed out or whose worker died (not for one that raised)."""
    memory_bytes: int = Field(2 * 2**30, gt=0)
    """A worker above this resident memory after an action is recycled."""
    num_cpus: float = Field(0.0, ge=0)
    """Ray CPUs reserved per worker. 0 by default: the engines and trainers' defaults reserve every CPU of a
    2-core machine, and a worker that cannot be placed would wait for ever (its work still uses real CPU)."""
    max_abandoned: int = Field(2, ge=1)
    """A worker holding this many abandoned (timed-out) action threads is recycled."""
    kill_grace_s: float = Field(5.0, ge=0)
    """A worker that has not answered ``timeout_s + kill_grace_s`` after an action started is killed."""
    spare_workers: int = Field(0, ge=0)
    """Idle workers kept ready beyond what the queue needs (up to ``max_workers``), so that an action arriving
    while the others are busy does not wait for a worker to start."""
    max_starting: int = Field(1, ge=1)
    """Workers the pool starts at once when it grows (a start costs a CPU for a while; meanwhile the queue drains
    to warm workers, which often makes the next start unnecessary)."""
    idle_grace_s: float = Field(0.5, ge=0)
    """A worker idle this long while the pool is above ``min_workers`` (and above what the queue needs) is retired."""
    hedge_after_s: float | None = Field(None, gt=0)
    """Start a duplicate copy of an attempt still running this long after its latest copy started (None: never).
    Off by default: a hedge only pays off for attempt-level stalls, and it doubles the work of slow actions."""
    max_hedges: int = Field(1, ge=1)
    """Duplicate copies an attempt may get (each ``hedge_after_s`` after the previous copy started)."""


class EnvironmentConfig(_Strict):
    """Which environment plugin runs the episodes, and its own options."""

    name: str
    """Registered environment name (see ``marl_pipeline.environment.available_environments``)."""
    options: dict[str, Any] = {}
    """Passed to the environment's constructor; the plugin validates them."""
    pool: PoolSettings | None = None
    """The action pool that runs the actions of a plugin with ``actions`` + ``run_action`` (workers, timeout,
    retries, memory); None: the plugin's own ``pool_settings``, else the defaults."""


class PipelineConfig(_Strict):
    """How work is cut into micro-batches and steps."""

    steps: int = Field(20, ge=1)
    """RL steps (optimizer steps of every agent) per launch of the train job."""
    prompts_per_micro_batch: int = Field(8, ge=1)
    """Task prompts per micro-batch."""
    samples_per_prompt: int = Field(8, ge=2)
    """Episodes sampled per prompt (the GRPO group size)."""
    micro_batches_per_step: int = Field(2, ge=1, le=16)
    """Micro-batches whose gradients accumulate into one optimizer step."""
    staleness: int = Field(0, ge=0)
    """Rollout for step i may use policy version v only when i - v <= staleness."""
    queue_size: int = Field(2, ge=1)
    """Micro-batches a stage may hold ahead of the next one (backpressure)."""
    mode: Literal["streaming", "synchronous"] = "streaming"
    """``synchronous`` puts a barrier after each stage for the whole step (for comparison, and as a fallback)."""
    environment_concurrency: int = Field(1, ge=1, le=64)
    """Micro-batches the environment stage works on at once."""
    reward_concurrency: int = Field(1, ge=1, le=64)
    """Micro-batches the reward stage works on at once."""

    @model_validator(mode="after")
    def validate_synchronous_is_on_policy(self) -> PipelineConfig:
        if self.mode == "synchronous" and self.staleness:
            raise ValueError("mode 'synchronous' trains strictly on-policy: staleness must be 0")
        return self


class AlgorithmConfig(_Strict):
    """Policy-gradient settings shared by every agent."""

    clip_eps: float = Field(0.2, gt=0)
    """PPO-style ratio clipping range."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature at rollout."""
    max_new_tokens: int = Field(8, ge=1)
    """Longest completion per turn, in tokens."""
    advantage_eps: float = Field(1e-6, gt=0)
    """Added to the group's reward std before dividing."""
    kl_coef: float = Field(0.0, ge=0)
    """Weight of the k3 KL penalty to the agent's base policy (version 0); > 0 keeps a frozen copy of it in the
    trainer."""
    entropy_coef: float = Field(0.0, ge=0)
    """Weight of the entropy bonus (full-vocabulary entropy at each response token), subtracted from the loss."""
    loss_normalization: Literal["token", "sequence"] = "token"
    """``token``: the step's summed token loss over its response-token count; ``sequence``: each sequence's mean
    token loss, averaged over the step's sequences."""
    tis_cap: float | None = Field(None, ge=1)
    """Truncated importance sampling: weight each token's policy-gradient term by min(trainer/engine ratio, cap)
    to correct the engine-vs-trainer mismatch; the PPO clip then uses the trainer's own ratio pi/sg(pi)
    (``runtime/losses.clipped_pg_token_loss``). None: off, the clip uses pi/pi_engine."""


class RewardModelConfig(_Strict):
    """A model-based reward mixed into the environment's rule-based one, served by a pool of Ray actors."""

    model: str = BUILTIN_TINY
    """``builtin:tiny`` (a tiny classifier trained at launch on the environment's ``reward_examples``, for CPU
    runs and tests) or a local Hugging Face model directory (sequence classification for ``classifier``, a
    causal LM for ``judge``)."""
    kind: Literal["classifier", "judge"] = "classifier"
    """``classifier``: the score is sigmoid of a one-logit head (softmax of the last label with several);
    ``judge``: a causal LM asked ``judge_template``, the score is P(judge_yes) / (P(judge_yes) + P(judge_no))."""
    agents: list[str] | None = None
    """Agents whose reward gets the model's score (None: every agent)."""
    weight: float = Field(0.5, ge=0, le=1)
    """An agent's reward is ``(1 - weight) * rule reward + weight * model score`` (1: the model's alone)."""
    judge_template: str = "{prompt}{response}\nIs that right? Answer:"
    """Judge prompt, with ``{prompt}`` and ``{response}`` of the scored turn."""
    judge_yes: str = " yes"
    """The judge's approving continuation (must be one token)."""
    judge_no: str = " no"
    """The judge's rejecting continuation (must be one token)."""
    max_length: int = Field(256, ge=8)
    """Tokens of one scored text; longer ones keep their end (the response)."""
    batch_size: int = Field(64, ge=1)
    """Texts per forward pass of a replica."""
    min_replicas: int = Field(1, ge=1)
    """Replicas (Ray actors, each holding the model) kept while the run lasts."""
    max_replicas: int = Field(2, ge=1)
    """Most replicas; the pool grows while more than ``batches_per_replica`` batches wait per replica."""
    batches_per_replica: int = Field(4, ge=1)
    """Pending batches per replica the pool aims for when it sizes itself."""
    num_cpus: float = Field(0.0, ge=0)
    """Ray CPUs reserved per replica. 0 by default: the engines and trainers' defaults reserve every CPU of a
    2-core machine, and a replica that cannot be placed would wait for ever (its work still uses real CPU)."""
    num_gpus: float = Field(0.0, ge=0)
    """Ray GPUs reserved per replica."""
    train_steps: int = Field(600, ge=1)
    """Training steps of the built-in model (``builtin:tiny`` only)."""

    @model_validator(mode="after")
    def validate_model_and_replicas(self) -> RewardModelConfig:
        if self.max_replicas < self.min_replicas:
            raise ValueError(f"max_replicas ({self.max_replicas}) < min_replicas ({self.min_replicas})")
        if self.model == BUILTIN_TINY and self.kind == "judge":
            raise ValueError("builtin:tiny is a classifier; a judge needs a causal LM directory in 'model'")
        if self.kind == "judge" and not ("{prompt}" in self.judge_template and "{response}" in self.judge_template):
            raise ValueError("judge_template must contain {prompt} and {response}")
        return self


class EvaluationConfig(_Strict):
    """Held-out evaluation of every agent (the plugin's ``evaluation_cases`` + ``evaluate``), greedy decoding."""

    every: int | None = Field(None, ge=1)
    """The train job evaluates policy versions 0, every, 2*every, ... and the launch's last (None: never; the
    ``evaluations`` asset still evaluates any stored version from the UI)."""
    cases_per_agent: int = Field(64, ge=2)
    """Held-out cases per agent, the same ones for every version."""
    max_new_tokens: int | None = Field(None, ge=1)
    """Longest answer (None: ``algorithm.max_new_tokens``)."""


class RayConfig(_Strict):
    """Where Ray runs."""

    address: str | None = None
    """None: an embedded local Ray; otherwise an existing cluster (``ray://host:10001`` or ``auto``)."""
    num_cpus: int | None = None
    """CPUs of the embedded local Ray (None: all of the machine's)."""


class StoreConfig(_Strict):
    """Where the experience store lives; a plain string in the YAML file is taken as ``uri``."""

    uri: str = ".marl/store"
    """A local directory (relative to the working directory) or ``s3://bucket/prefix``."""
    endpoint_url: str | None = None
    """S3-compatible endpoint (MinIO, moto, ...); None: AWS_ENDPOINT_URL or AWS's own."""
    region: str | None = None
    """S3 region; None: AWS_REGION / AWS_DEFAULT_REGION."""
    access_key_id: str | None = Field(None, repr=False)
    """None: the standard AWS chain (AWS_ACCESS_KEY_ID, ~/.aws, instance role); prefer that to the YAML file."""
    secret_access_key: str | None = Field(None, repr=False)
    """None: the standard AWS chain (AWS_SECRET_ACCESS_KEY, ...)."""
    policy_cache: str | None = None
    """Local directory for policy checkpoints of an ``s3://`` store (vLLM loads from a local path);
    None: ``.marl/cache/<bucket>/<prefix>``. Unused for a local store (checkpoints live in it)."""
    compression: Literal["zstd", "snappy", "lz4", "gzip", "none"] = "zstd"
    """Parquet compression of stage partitions."""

    def __str__(self) -> str:
        # Code written when ``store`` was a plain string (f"{config.store}", str(config.store)) keeps working.
        return self.uri

    @field_validator("uri")
    @classmethod
    def validate_uri_scheme(cls, uri: str) -> str:
        scheme = uri.split("://", 1)[0] if "://" in uri else "file"
        if scheme not in ("file", "s3"):
            raise ValueError(f"store URI {uri!r}: scheme {scheme!r} is not supported (a local path or s3://)")
        return uri


def _store_from_uri(value: Any) -> Any:
    return {"uri": str(value)} if isinstance(value, str | Path) else value


class ExperimentConfig(_Strict):
    """A whole experiment: what the ``marl train`` command and the Dagster ``train`` job take."""

    run: str = Field(pattern=r"^[A-Za-z0-9_.]+$")
    """Run name: one training lineage in the store; letters, digits, ``_`` and ``.``."""
    seed: int = 0
    """Seeds task sampling, model building, warm-up and rollout sampling."""
    store: Annotated[StoreConfig, BeforeValidator(_store_from_uri)] = StoreConfig()
    """Experience store: a URI string (local directory or ``s3://...``) or a mapping of ``StoreConfig`` fields."""
    environment: EnvironmentConfig
    agents: dict[str, AgentConfig]
    pipeline: PipelineConfig = PipelineConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    reward_model: RewardModelConfig | None = None
    """A model-based reward mixed into the environment's (None: the environment's rule-based reward alone)."""
    evaluation: EvaluationConfig = EvaluationConfig()
    ray: RayConfig = RayConfig()

    @field_validator("agents")
    @classmethod
    def validate_agents_not_empty(cls, agents: dict[str, AgentConfig]) -> dict[str, AgentConfig]:
        if not agents:
            raise ValueError("at least one agent is required")
        return agents


def _format_validation_error(error: ValidationError, source: str) -> str:
    lines = [f"invalid config {source}:"]
    for item in error.errors():
        field = ".".join(str(part) for part in item["loc"]) or "<root>"
        message = "unknown field" if item["type"] == "extra_forbidden" else item["msg"]
        lines.append(f"  {field}: {message}")
    return "\n".join(lines)


def parse_config(data: dict[str, Any], source: str = "<dict>") -> ExperimentConfig:
    """Validate a config dict, including agents against the environment's roles.

    Raises:
        ConfigError: naming each offending field.
    """
    from marl_pipeline.environment import EVALUATION_HOOKS, get_environment_class, roles_of

    if not isinstance(data, dict):
        raise ConfigError(f"invalid config {source}: expected a mapping at the top level")
    try:
        config = ExperimentConfig.model_validate(data)
    except ValidationError as error:
        raise ConfigError(_format_validation_error(error, source)) from None
    try:
        env_class = get_environment_class(config.environment.name)
    except KeyError as error:
        raise ConfigError(f"invalid config {source}:\n  environment.name: {error.args[0]}") from None
    roles = roles_of(env_class)
    unknown = [name for name in config.agents if name not in roles]
    if unknown:
        raise ConfigError(
            f"invalid config {source}:\n  agents.{unknown[0]}: unknown agent; "
            f"environment {config.environment.name!r} has roles {list(roles)}"
        )
    missing = [role for role in roles if role not in config.agents]
    if missing:
        raise ConfigError(f"invalid config {source}:\n  agents: missing agent(s) {missing} required by the environment")
    reward_model = config.reward_model
    if reward_model is not None:
        unknown = [name for name in reward_model.agents or [] if name not in roles]
        if unknown:
            raise ConfigError(f"invalid config {source}:\n  reward_model.agents: unknown agent {unknown[0]!r}; "
                              f"environment {config.environment.name!r} has roles {list(roles)}")
        if reward_model.model == BUILTIN_TINY and not hasattr(env_class, "reward_examples"):
            raise ConfigError(f"invalid config {source}:\n  reward_model.model: environment "
                              f"{config.environment.name!r} has no reward_examples to train builtin:tiny on; "
                              f"give a model directory")
    if config.evaluation.every is not None and not all(hasattr(env_class, hook) for hook in EVALUATION_HOOKS):
        raise ConfigError(f"invalid config {source}:\n  evaluation.every: environment {config.environment.name!r} "
                          f"lacks evaluation_cases/evaluate/answer_of to measure its agents on held-out cases")
    try:
        env_class.Options.model_validate(config.environment.options)
    except ValidationError as error:
        raise ConfigError(_format_validation_error(error, source).replace("\n  ", "\n  environment.options.")) from None
    return config


def load_config(path: str | Path) -> ExperimentConfig:
    """Read and validate one YAML experiment file."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:
        raise ConfigError(f"invalid YAML in {path}: {error}") from None
    return parse_config(data, source=str(path))
