"""What a run uses besides its agents: a reward model, held-out evaluation, Ray, the store, data-driven retraining."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from marl_pipeline.config.base import BUILTIN_TINY, StrictModel


class RewardModelConfig(StrictModel):
    """A model-based reward mixed into the environment's rule-based one, served by a pool of Ray actors."""

    model: str = BUILTIN_TINY
    """``builtin:tiny`` (a judge taught at launch on ``reward_examples``) or a HF directory (classifier or judge)."""
    kind: Literal["classifier", "judge"] | None = None
    """``classifier``: the score is sigmoid of a one-logit head (softmax of the last label with several);
    ``judge``: a causal LM asked ``judge_template``, the score is P(judge_yes) / (P(judge_yes) + P(judge_no));
    None: ``judge`` for ``builtin:tiny``, ``classifier`` for a directory."""
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
    train_steps: int = Field(2000, ge=1)
    """Training steps of the built-in judge (``builtin:tiny`` only), its rate decaying linearly to a tenth over them:
    at a constant rate 1000 left an AVX2 host under 0.9 of the demo's held-out verdicts right, and 2000 an AVX512
    one at 0.88; with the decay, 0.98 at 1000 and 0.99 at 2000 there."""

    @model_validator(mode="after")
    def validate_model_and_replicas(self) -> RewardModelConfig:
        if self.max_replicas < self.min_replicas:
            raise ValueError(f"max_replicas ({self.max_replicas}) < min_replicas ({self.min_replicas})")
        if self.model == BUILTIN_TINY and self.kind == "classifier":
            raise ValueError("builtin:tiny is a judge (a causal LM); a classifier needs a sequence-classification "
                             "directory in 'model'")
        fields = ("{prompt}", "{response}")
        if self.model_kind == "judge" and not all(field in self.judge_template for field in fields):
            raise ValueError("judge_template must contain {prompt} and {response}")
        return self

    @property
    def model_kind(self) -> str:
        """``kind`` as the model is served."""
        return self.kind or ("judge" if self.model == BUILTIN_TINY else "classifier")


class EvaluationConfig(StrictModel):
    """Held-out evaluation of every agent (the plugin's ``evaluation_cases`` + ``evaluate``), greedy decoding."""

    every: int | None = Field(None, ge=1)
    """The train job evaluates policy versions 0, every, 2*every, ... and the launch's last (None: never; the
    ``evaluations`` asset still evaluates any stored version from the UI)."""
    cases_per_agent: int = Field(64, ge=2)
    """Held-out cases per agent, the same ones for every version."""
    max_new_tokens: int | None = Field(None, ge=1)
    """Longest answer (None: ``algorithm.max_new_tokens``)."""
    team_samples: int | None = Field(None, ge=0)
    """Episodes sampled per held-out case of the answering role to measure the team (a plugin with ``team_choice``,
    stages/team.py); None: ``pipeline.samples_per_prompt``, as in training; 0: the team is not measured."""


class HealthConfig(StrictModel):
    """When an agent's training-health signals (stages/health.py) are reported as collapse: a warning in the run's
    log and on the CLI, and the ``health`` asset's ``no_collapse_in_training`` check failing, with the agent, steps
    and figures."""

    top_answer_share: float = Field(0.9, gt=0, le=1)
    """Above this share of one response over all the agent's responses of a step: the same answer to
    everything (the demo's verifier stays at 0.4-0.75 while it learns)."""
    zero_variance_groups: float = Field(0.95, gt=0, le=1)
    """Above this share of GRPO groups with equal rewards: almost no learning signal left."""
    steps: int = Field(3, ge=1)
    """For this many steps in a row."""
    window: int = Field(8, ge=2)
    """Steps over which a share hovering around ``top_answer_share`` is judged (``window_share``)."""
    window_share: float = Field(0.8, gt=0, le=1)
    """Above this mean ``top_answer_share`` over ``window`` steps, while the agent's mean reward rose by no more
    than ``window_gain`` from the window's first half to its second: collapse, though no three steps in a row
    passed ``top_answer_share`` (a share at 0.83, 0.75, 0.81, 0.88, 0.96, 0.91, 0.79, 0.90)."""
    window_gain: float = Field(0.05, ge=0)
    """The rise of mean reward over the window that clears a high share: an agent learning the right answers."""
    converged_margin: float = Field(0.05, ge=0)
    """A most frequent answer that earns within this of the best reward the agent's turns earned is convergence, not
    collapse: an answer right almost everywhere (a reporter saying "none" where its checker said no) is not one
    answer to everything whatever is right (a checker saying "no" where it is right 55-77% of the time)."""
    on_collapse: Literal["warn", "stop"] = "warn"
    """``warn``: the run goes on, warned. ``stop``: the launch ends after the step where an agent is seen collapsing
    (the same answer to everything, not convergence; "no learning signal" only warns), its versions checkpointed and
    the launch left to resume; the Dagster run fails with the reason, and ``marl train`` names the agent and how to
    resume after a change of settings."""


class WandbConfig(StrictModel):
    """Weights & Biases (``tracking.wandb``): one wandb run per run, named after it, continued by its later
    launches. Offline by default: files under ``dir`` that ``wandb sync`` uploads later, no network."""

    project: str = "marl-pipeline"
    mode: Literal["offline", "online"] = "offline"
    dir: str = ".marl/wandb"
    """Where wandb writes its files (a ``wandb/`` folder in it)."""
    tags: list[str] = Field(default_factory=list)
    """Besides the run's own: its environment and its agents' names."""


class TrackingConfig(StrictModel):
    """Step metrics sent besides the Dagster UI, where ML engineers follow training (off by default)."""

    tensorboard: str | None = None
    """A directory: each run's event files go to ``<directory>/<run>`` (``tensorboard --logdir <directory>``)."""
    mlflow: str | None = None
    """An MLflow tracking URI (``http://127.0.0.1:5000``, ``sqlite:///mlflow.db``): one MLflow run per run,
    continued by its later launches."""
    mlflow_experiment: str = "marl-pipeline"
    """The MLflow experiment the runs go to (created when missing)."""
    wandb: WandbConfig | None = None
    """Weights & Biases (``wandb: {}``: offline, project ``marl-pipeline``)."""


RAY_BUILTIN_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")
"""Resources Ray defines itself: requested through ``num_cpus`` / ``num_gpus``, never as custom resources."""


class RayConfig(StrictModel):
    """Where Ray runs, and on which nodes the engines and trainers go."""

    address: str | None = None
    """None: an embedded local Ray; otherwise an existing cluster (``ray://host:10001``, ``host:6379`` or ``auto``)."""
    num_cpus: int | None = None
    """CPUs of the embedded local Ray (None: all of the machine's)."""
    resident_trainers: int | None = Field(None, ge=1)
    """Most trainers held in memory; fewer than the agents swaps their state through Ray (training/swap.py)."""
    engine_resources: dict[str, float] = Field(default_factory=dict)
    """Custom Ray resources each agent's engine asks for besides its CPUs and GPUs, e.g. ``{engines: 1}``: it then
    runs only on nodes started with them (``ray start --resources '{"engines": 4}'``). Empty: any node."""
    trainer_resources: dict[str, float] = Field(default_factory=dict)
    """The same for each agent's trainer, e.g. ``{trainers: 1}``."""
    keep_actors: bool = False
    """Keep a clean launch's engines and trainers for the next launch in this process (warm_actors.py)."""
    weight_sync: Literal["object_store", "broadcast"] = "object_store"
    """How a new version's weights reach an agent's engine replicas: ``object_store``, the trainer's copy through
    Ray's object store, each replica fetching it; ``broadcast``, one torch.distributed broadcast from the trainer to
    all the replicas, in buckets (gloo on CPU, NCCL on GPUs: policy/transfer.py). Each agent's trainer must be its
    own actor (not with ``resident_trainers`` below the number of agents)."""

    def local_init_options(self, options: dict) -> dict:
        """``ray.init`` options for the embedded local Ray: ``options`` with ``num_cpus`` unless they name one (the
        Ray resource and the ``marl`` CLI, which starts that Ray early, both start it so)."""
        return options if self.num_cpus is None else {"num_cpus": self.num_cpus, **options}

    @field_validator("engine_resources", "trainer_resources")
    @classmethod
    def validate_custom_resources(cls, resources: dict[str, float]) -> dict[str, float]:
        for name, amount in resources.items():
            if name in RAY_BUILTIN_RESOURCES or name.startswith("node:"):
                raise ValueError(f"{name!r} is Ray's own resource: set agents.<name>.engine/trainer.num_cpus or "
                                 f"num_gpus instead (custom resources name node groups, e.g. engines: 1)")
            if not amount > 0:
                raise ValueError(f"resource {name!r}: amount {amount:g} must be > 0")
        return resources


class RetrainConfig(StrictModel):
    """Data-driven retraining: Dagster's ``retrain_on_new_tasks`` sensor starts the train job when task files land."""

    watch: str | None = None
    """A directory or ``s3://bucket/prefix`` holding the environment's task files (an S3 prefix is read with the
    store's endpoint and keys); None: the sensor starts nothing."""
    pattern: str = "*"
    """Which files under ``watch`` are task files: a glob matched against each file's name."""
    settle_s: float = Field(30.0, ge=0)
    """A batch counts once no task file has changed for this long, so a batch still being copied waits and starts
    one run when complete, not one per sensor tick it straddles."""

    @field_validator("watch")
    @classmethod
    def validate_watch_scheme(cls, watch: str | None) -> str | None:
        if watch is not None and "://" in watch and not watch.startswith(("s3://", "file://")):
            raise ValueError(f"retrain.watch {watch!r}: only a local directory or s3:// is supported")
        return watch


class RetentionConfig(StrictModel):
    """Which policy versions the store keeps once newer ones are committed (``store.retention``).

    Version 0 (the base policy, the KL reference and every evaluation's starting point) is always kept, and so
    is each agent's newest version (a resumed launch starts from it, optimizer state included). Pruning runs as
    each new version is committed. A pruned version is gone with its optimizer state: recomputing a partition or
    evaluating a version that needs it fails with an error naming the version."""

    keep_last: int = Field(2, ge=1)
    """The newest versions kept per agent."""
    keep_every: int | None = Field(25, ge=1)
    """Also keep every version divisible by this (None: no such milestones)."""
    keep_all: bool = False
    """Keep every version (no pruning), as before retention existed."""


class StoreConfig(StrictModel):
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
    retention: RetentionConfig = RetentionConfig()
    """Which policy versions (weights and optimizer state) are kept."""

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

