"""A small synthetic run written through the store (no engines): for inspection, metadata, check and recomputation
tests; and an action environment over its turns."""

from __future__ import annotations

import json
import os
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pyarrow as pa
from pydantic import BaseModel, ConfigDict

from marl_pipeline.environment import Action, ActionResult
from marl_pipeline.store import ExperienceStore, MicroBatchKey
from marl_pipeline.store.schema import ENVIRONMENT_RESULTS, REWARDS, ROLLOUTS, with_agent

AGENTS = ("solver", "verifier")
VOCAB = 100


def write_run(store: ExperienceStore, run: str = "r", steps: int = 2, micro_batches: int = 2,
              episodes: int = 4, failed_episode: int | None = 1) -> None:
    """Rollouts, environment results and rewards of ``steps`` x ``micro_batches``, and version-0 policy configs."""
    rng = np.random.default_rng(0)
    now = datetime.now(UTC)
    for agent in AGENTS:
        directory = store.policy_dir(run, agent, 0)
        directory.mkdir(parents=True, exist_ok=True)
        Path(directory, "config.json").write_text(json.dumps({"vocab_size": VOCAB}))
    for step in range(steps):
        for micro_batch in range(micro_batches):
            key = MicroBatchKey(run, step, micro_batch)
            turns = [(episode, turn, agent) for episode in range(episodes) for turn, agent in enumerate(AGENTS)]
            common = {
                "sample_id": [f"{step}-{micro_batch}-{e // 2}_{t}_{e % 2}" for e, t, _ in turns],
                "episode": [e for e, _, _ in turns], "task_id": [f"{e}+{e}" for e, _, _ in turns],
                "group_id": [f"{step}-{micro_batch}-{e // 2}" for e, _, _ in turns],
                "trajectory": [e % 2 for e, _, _ in turns], "role": [a for _, _, a in turns],
                "turn": [t for _, t, _ in turns], "agent": [a for _, _, a in turns],
            }
            n = len(turns)
            failed = [failed_episode is not None and e == failed_episode and step == 0 and micro_batch == 0
                      for e, _, _ in turns]
            rollouts = {**common, "task": ["{}"] * n, "policy_version": [max(step - 1, 0)] * n, "engine": ["e0"] * n,
                        "adapter": [None] * n,
                        "prompt_text": [f"What is {e}+{e}?" for e, _, _ in turns],
                        "response_text": [f"{2 * e}" if a == "solver" else "correct" for e, _, a in turns],
                        "prompt_ids": [list(rng.integers(0, VOCAB, 5)) for _ in turns],
                        "response_ids": [list(rng.integers(0, VOCAB, 3)) for _ in turns],
                        "logprobs": [list(-rng.random(3)) for _ in turns], "finish_reason": ["stop"] * n,
                        "observation": [None] * n,
                        "rollout_start": [now] * n, "rollout_end": [now] * n, "engine_seconds": [None] * n,
                        "observe_seconds": [None] * n,
                        "group_shortfall": [0] * n, "group_dropped": [0] * n,
                        "status": ["ok"] * n, "error": [None] * n}
            results = {**common, "outcome": ["right"] * n, "success": [True] * n, "observation": [""] * n,
                       "info": ["{}"] * n, "environment_start": [now] * n, "environment_end": [now] * n,
                       "status": ["failed" if f else "ok" for f in failed],
                       "error": ["ValueError: boom" if f else None for f in failed]}
            rewards = {**common, "reward": [0.0 if f else float(rng.random()) for f in failed],
                       "advantage": list(rng.standard_normal(n)), "model_score": [None] * n,
                       "reward_start": [now] * n, "reward_end": [now] * n,
                       "status": ["failed" if f else "ok" for f in failed], "error": [None] * n}
            for stage, schema, columns in (("rollouts", ROLLOUTS, rollouts),
                                           ("environment_results", ENVIRONMENT_RESULTS, results),
                                           ("rewards", REWARDS, rewards)):
                store.commit(stage, key, pa.table(columns, schema=with_agent(schema)))


class WhereActionsRun:
    """Tests-only action environment over :func:`write_run`'s two-turn episodes: each turn is one action whose
    result records where it ran: the process (to tell the action pool's workers from the caller) and the CPUs of
    its Ray cluster (None outside Ray). Registered with
    ``register_environment`` by the tests that use it; kept in this light module because the pool's workers
    import it to unpickle ``run_action``."""

    name = "where_actions_run"
    turn_order = AGENTS

    class Options(BaseModel):
        model_config = ConfigDict(extra="forbid")

    def __init__(self, options) -> None:
        pass

    def sample_tasks(self, rng, count):
        return [{"id": str(i)} for i in range(count)]

    def render_prompt(self, role, task, transcript):
        return f"{role}:"

    def actions(self, task, transcript):
        return [Action("echo", turn.text, 0.1) for turn in transcript]

    def run_action(self, action):
        import ray

        cpus = ray.cluster_resources().get("CPU") if ray.is_initialized() else None
        return ActionResult("ran", True, info={"pid": os.getpid(), "cluster_cpus": cpus})

    def score(self, task, transcript, results):
        return {agent: 1.0 for agent in AGENTS}

    def text_corpus(self, rng, count):
        return []

    def warmup_examples(self, role, rng, count):
        return []
