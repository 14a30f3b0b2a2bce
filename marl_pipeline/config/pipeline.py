"""How a run is cut: the environment and its action pool, micro-batches and steps."""

from __future__ import annotations

import math
from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from marl_pipeline.config.base import StrictModel


class PoolSettings(StrictModel):
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


class EnvironmentConfig(StrictModel):
    """Which environment plugin runs the episodes, and its own options."""

    name: str
    """Registered environment name (see ``marl_pipeline.environment.available_environments``)."""
    options: dict[str, Any] = Field(default_factory=dict)
    """Passed to the environment's constructor; the plugin validates them."""
    pool: PoolSettings | None = None
    """The action pool that runs the actions of a plugin with ``actions`` + ``run_action`` (workers, timeout,
    retries, memory); None: the plugin's own ``pool_settings``, else the defaults."""


class RolloutConfig(StrictModel):
    """How the rollout stage samples a micro-batch's episodes: every episode is its own task, its next turn requested
    as soon as its previous turn and the environment's reply are done (stages/trajectories.py)."""

    removed_keys: ClassVar[dict[str, str]] = {
        "mode": "pipeline.rollout.mode is gone: trajectory-level rollout is the one rollout (the turn-batched "
                "baseline is tests/turn_batched.py); remove the key"}
    episode_timeout_s: float | None = Field(None, gt=0)
    """Cut an episode still running this long after its micro-batch started (stored failed); None: no limit."""
    observe_threads: int = Field(32, ge=1, le=256)
    """Environment replies (``observe``) computed at once, each on a driver thread."""
    observe_on: Literal["thread", "action_pool"] = "thread"
    """Where a reply is computed: a driver thread, or the run's action pool (a reply that costs real time: running
    code, a tool; the plugin must then be an action environment, which has the pool, and picklable)."""

    lanes: bool = True
    """A new episode's turn goes to the replica its previous turn used at an agent with as many replicas (unless
    draining, down or saturated), so one engine step's results reach the next agent's replicas whole
    (inference/router.py); False: to the least outstanding replica."""
    rebalance_replicas: bool = False
    """Between steps, split the engine replicas by each agent's tokens (needs equal engine resources)."""
    oversample: int | float = 0
    """Extra episodes started per group (an int k >= 0, or a fraction in (0, 1] of ``samples_per_prompt``, rounded
    up: ``1`` is one episode, ``1.0`` is n): a group keeps the first n that finish and the rest are cut and stored
    ``dropped``, so a slow or hung episode holds neither its group nor the micro-batch."""

    @field_validator("oversample", mode="before")
    @classmethod
    def _oversample_is_no_bool(cls, value: Any) -> Any:
        if isinstance(value, bool):  # an int to pydantic: "true" would start one extra episode
            raise ValueError(f"oversample must be an int k >= 0 or a fraction in (0, 1], got {value!r}")
        return value

    @field_validator("oversample")
    @classmethod
    def _check_oversample(cls, value: int | float) -> int | float:
        if isinstance(value, int) and value < 0:
            raise ValueError(f"oversample must be an int k >= 0 (extra episodes per group), got {value}")
        if isinstance(value, float) and not 0.0 < value <= 1.0:
            raise ValueError(f"oversample as a fraction of samples_per_prompt must be in (0, 1], got {value} (an "
                             "int k >= 0 gives k extra episodes; 0: none)")
        return value

    def extra_episodes(self, samples_per_prompt: int) -> int:
        """Episodes started per group beyond the n it keeps."""
        if isinstance(self.oversample, float):
            return math.ceil(self.oversample * samples_per_prompt)
        return self.oversample



class PipelineConfig(StrictModel):
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
    checkpoint_every: int = Field(1, ge=1)
    """Save and commit every this many policy versions (and always a launch's last): the weights and AdamW state of a
    large model take seconds to save. A launch killed in between resumes from the newest committed version and
    retrains the steps since from their committed partitions, to the same parameters."""
    mode: Literal["streaming", "synchronous"] = "streaming"
    """``synchronous`` puts a barrier after each stage for the whole step (for comparison, and as a fallback)."""
    environment_concurrency: int = Field(1, ge=1, le=64)
    """Micro-batches the environment stage works on at once."""
    reward_concurrency: int = Field(1, ge=1, le=64)
    """Micro-batches the reward stage works on at once."""
    rollout: RolloutConfig = RolloutConfig()
    """How a micro-batch's episodes are sampled."""

    @model_validator(mode="after")
    def validate_synchronous_is_on_policy(self) -> PipelineConfig:
        if self.mode == "synchronous" and self.staleness:
            raise ValueError("mode 'synchronous' trains strictly on-policy: staleness must be 0")
        return self

    def checkpoint_due(self, step: int, last_step: int) -> bool:
        """Whether the version step ``step`` makes is saved and committed (``checkpoint_every``, a launch's last)."""
        return (step + 1) % self.checkpoint_every == 0 or step == last_step

    def staleness_bound(self, agent_staleness: int | None = None) -> int:
        """An agent's staleness bound: its own (``agents.<a>.staleness``) or the pipeline's, and 0 in synchronous
        mode, which trains strictly on-policy. The one rule, for the orchestrator's gate and the planner."""
        if self.mode == "synchronous":
            return 0
        return self.staleness if agent_staleness is None else agent_staleness

    def queue_capacity(self) -> int:
        """Micro-batches a stage's outbox holds: ``queue_size``, and in synchronous mode at least a step's, whose
        barrier lets none on until all are in. The one rule, for the orchestrator and the planner."""
        return max(self.queue_size, self.micro_batches_per_step if self.mode == "synchronous" else 1)
