"""What a training launch tells its caller as it goes (the Dagster op, the CLI, benchmarks, tests).

Produced by ``recipe.train`` (``SetupPhase``, ``RunStarted``, ``RunFinished``) and the orchestrator (the rest); consumed
by ``assets/train.py`` (materializations, logs) and ``pipeline_metrics`` (run-level figures).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa

from marl_pipeline.bootstrap.policies import BasePolicy
from marl_pipeline.cluster.placement import PlacementPlan
from marl_pipeline.run.launches import LaunchPlan
from marl_pipeline.store import MicroBatchKey


@dataclass(frozen=True)
class StageTiming:
    """Wall-clock facts of one stage of one micro-batch (epoch seconds)."""

    enqueued: float
    """When the micro-batch became ready for the stage (its inputs committed, or the gate opened)."""
    started: float
    ended: float
    """When its output was computed; the commit follows (``StageCommitted.handed`` and ``committed``)."""


@dataclass(frozen=True)
class StageCommitted:
    """A stage's output for one micro-batch is committed to the store.

    ``table`` is the committed partition, for whoever wants a look now (metadata, totals); a consumer that
    keeps events for long should keep what it needs of it, not the event (the table holds every turn).
    """

    stage: str
    key: MicroBatchKey
    path: Path | str
    timing: StageTiming
    table: pa.Table = field(repr=False)
    committed: float | None = None
    """When the commit's write finished (epoch seconds), on the store's writer thread."""
    handed: float | None = None
    """When the stage's thread was done with the commit (validated, kept in memory, queued for the writer):
    ``handed - timing.ended`` is what the commit costs the stage."""
    cpu_seconds: float | None = None
    """The stage thread's CPU time while computing: what of the span the driver computed, not waited for."""

    @property
    def seconds(self) -> float:
        return self.timing.ended - self.timing.started


@dataclass(frozen=True)
class PolicyCommitted:
    """A new policy version of one agent is trained, synced into its engine and saved."""

    agent: str
    version: int
    step: int
    path: Path | str
    """The version's directory (a URI in an S3 store)."""
    grad_norm: float
    tokens: int
    timing: StageTiming
    sync_seconds: float = 0.0
    """From the optimizer step's end to every engine replica serving the version: what holds the next rollout at
    staleness 0 (the checkpoint is saved and committed after it, while rollout goes on)."""
    computed_tokens: int = 0
    """Real tokens (prompts and responses, no padding) the step's passes computed."""
    tokens_per_second: float = 0.0
    """The trainer's ``computed_tokens`` over its own seconds in the step's passes and optimizer step."""
    mfu: float = 0.0
    """The trainer's model FLOPs utilization in the step, a fraction (training/flops.py)."""


@dataclass(frozen=True)
class TrainerPasses:
    """How one agent's trainer runs its passes, told once a launch, with its first step (the token budget is sized at
    the first pass): ``PolicyTrainer.pass_settings()``."""

    agent: str
    step: int
    settings: dict

    def describe(self) -> str:
        """How the passes run, short: packed or padded, the budget and where it came from, device and precision (why
        padded stays in the settings, which every version's timing.json records)."""
        settings = self.settings
        budget = (f" of {settings['chunk_tokens']:,} tokens ({settings['budget_why']})"
                  if settings.get("chunk_tokens") else " (no pass ran to size their budget)")
        return f"{settings['passes']} passes{budget} on {settings['device']}, {settings['dtype']}"


def describe_passes(told: list[TrainerPasses]) -> list[str]:
    """The trainers' passes as set-up facts, one line per distinct way of running them with the agents that share
    it: "trainers of solver, verifier: padded passes of 2,048 tokens (the CPU's default) on cpu, float32"."""
    agents: dict[str, list[str]] = {}
    for event in told:
        agents.setdefault(event.describe(), []).append(event.agent)
    return [f"trainers of {', '.join(sorted(names))}: {how}" for how, names in agents.items()]


@dataclass(frozen=True)
class StepFinished:
    """Every agent has stepped past ``step``: its reward summary and times, for progress displays."""

    step: int
    mean_reward: dict[str, float]
    seconds: float
    """Since the previous step finished (the launch's first step: since its first rollout): the step time that
    throughput is, overlap included."""
    span_seconds: float
    """From the step's first rollout to its last commit: longer than ``seconds`` when steps overlap (staleness)."""
    health: dict[str, dict[str, float | None]] = field(default_factory=dict)
    """Per agent, its training-health signals at this step (stages/health.py; stored in the ``health`` dataset)."""
    warnings: list[str] = field(default_factory=list)
    """What the signals of the steps up to this one show collapsing (``stages.health.collapse_warnings``)."""
    services: dict[str, dict] = field(default_factory=dict)
    """Per external service, its figures in the step (calls, 429s, queue wait, quota use: the ``services``
    dataset's columns)."""


@dataclass(frozen=True)
class SetupPhase:
    """One part of a launch's set-up is done, before ``RunStarted``: what was done, and its seconds (an engine or
    trainer coming up: since the workers were asked for, as they start side by side)."""

    name: str
    seconds: float


@dataclass(frozen=True)
class RunStarted:
    """Base policies are ready and the workers are up."""

    run: str
    plan: LaunchPlan
    base_policies: list[BasePolicy]
    setup_seconds: float
    placement: PlacementPlan


@dataclass(frozen=True)
class RunFinished:
    """Every step of the launch is committed."""

    run: str
    plan: LaunchPlan
    started: float
    ended: float
    placement: PlacementPlan


@dataclass(frozen=True)
class CollapseStopped:
    """The launch ended after ``step`` because agents were seen collapsing (``health.on_collapse: stop``): every
    agent's version ``step + 1`` is committed and the launch is left unfinished, for a relaunch to resume."""

    run: str
    step: int
    warnings: list[str]

    @property
    def agents(self) -> list[str]:
        return sorted({warning.split(" ", 1)[0] for warning in self.warnings})

    def reason(self) -> str:
        """What a user reads: what collapsed, what was kept, and how to go on after a change of settings."""
        agent = self.agents[0]
        return (f"run {self.run!r} stopped after step {self.step} (health.on_collapse: stop): "
                f"{'; '.join(self.warnings)}. Every agent's version {self.step + 1} is committed and the launch is "
                f"unfinished: change what lets {', '.join(self.agents)} collapse (what held a verifier: a "
                f"class-balanced reward in the environment with --set agents.{agent}.algorithm.advantage.type=dr_grpo, "
                f"which keeps its weights; docs/environments.md, \"When a verifier collapses\") and run the same "
                f"command again: it resumes from version {self.step + 1}")


@dataclass(frozen=True)
class EvaluationCommitted:
    """Every agent's held-out evaluation of one policy version is committed (``evaluations``, step=version)."""

    version: int
    path: Path | str
    metrics: dict[str, dict[str, float]]
    """Per agent: the plugin's metrics, then answer_entropy, top_answer_share and collapsed."""


@dataclass(frozen=True)
class ReplicaChanged:
    """An engine replica died mid-run and was taken out of routing (``state`` "down": the agent's other replicas
    serve on), then came back serving ``version`` ("up"), or could not be restarted ("failed": ``detail`` says
    why; it stays down). Planned changes (``rebalance_replicas``' resizes) are not reported."""

    agent: str
    replica: int
    state: str
    version: int | None = None
    detail: str = ""


@dataclass(frozen=True)
class ThreadsChanged:
    """Trainers' threads moved after a step to follow their measured demand (cluster/cores.py)."""

    step: int
    changed: dict[str, tuple[int, int]]
    """Trainer -> (threads before, after)."""
    cores: dict[str, float]
    """The cores each engine and trainer kept busy since the previous step's end, on average."""


@dataclass(frozen=True)
class LayoutChanged:
    """The launch ended after ``step`` because some agents' turns reached another range of their
    ``parallelism_by_length``: the next launch resumes at ``step + 1`` in the new layout (run/layouts.py)."""

    step: int
    changed: dict[str, tuple[str, str]]
    """Agent -> (its layout before, after), described."""
    lengths: dict[str, int]
    """Each agent's longest turn (prompt + response tokens) in the step."""


Event = StageCommitted | PolicyCommitted | TrainerPasses | StepFinished | EvaluationCommitted | ReplicaChanged
"""What the orchestrator yields."""

LaunchEvent = SetupPhase | RunStarted | Event | ThreadsChanged | LayoutChanged | RunFinished | CollapseStopped
"""What ``recipe.train`` yields."""


def mean_reward(rewards: dict[str, float]) -> float:
    """The step reward reported to users: the mean over agents of their mean episode reward."""
    return sum(rewards.values()) / max(len(rewards), 1)
