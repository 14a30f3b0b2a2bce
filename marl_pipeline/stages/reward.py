"""Reward stage: the environment's per-agent reward of each episode, and group-relative advantages.

Advantages: the ``n`` episodes sampled from one task prompt form a group (the rollouts' ``group_id``); an agent's
rewards are compared within its group by the configured estimator (``algorithm.advantage``, stages/advantages/:
GRPO's (reward - mean) / std by default).

Credit assignment: the environment scores each agent on its own part (``score``); each agent is then
trained on ``w * team + (1 - w) * own`` where ``team`` is the mean over the episode's agents and ``w``
the ``team_weight`` (0: individual reward, the default; 1: shared team reward; between: a mix). A
plugin sets its default with a ``team_reward_weight`` attribute (usually from its options).

Turn-level credit (optional): a plugin with ``score_turns(task, transcript, results)`` may give each turn its own
reward (a list, one per turn, or None for the episode's per-agent reward). An agent that speaks several times then
learns each turn from that turn's reward (a verifier's working from its grade, its verdict from whether it follows
from the working) instead of one sum that mixes the two signals' noise. Advantages are then relative per (group,
agent, turn): each turn of an episode is compared with the same turn of the group's other episodes. Team credit
mixes the team mean of ``score`` into each turn's reward, and a reward model's score into the agent's last turn's.

Model-based reward (:class:`ModelReward`, optional): before credit assignment, each scored agent's own
reward becomes ``(1 - weight) * rule + weight * model score``, the model scoring the agent's last turn of
the episode (its final say). The score is stored in ``model_score`` on that turn's row. A failed episode
is not sent to the model.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

from marl_pipeline.config import Advantage, ExperimentConfig, GRPOAdvantage, JudgeConfig, RewardModelConfig
from marl_pipeline.environment import ActionResult, Environment
from marl_pipeline.hooks import hooks_of
from marl_pipeline.services.judge import JudgeScorer
from marl_pipeline.stages import advantages, credit
from marl_pipeline.stages.episodes import TURN_KEYS, episodes_of, kept_turns, transcript_of
from marl_pipeline.store import ExperienceStore, MicroBatchKey
from marl_pipeline.store.recent import RecentCommits
from marl_pipeline.store.schema import REWARDS, with_agent

if TYPE_CHECKING:
    from marl_pipeline.inference.reward_model import RewardModelPool


@dataclass(frozen=True)
class ModelReward:
    """A reward model's part in the reward: its scorer, which agents it scores, and its weight in the mix."""

    score: Callable[[list[str], list[str]], list[float]]
    """(prompts, responses) -> a score in [0, 1] each (e.g. ``RewardModelPool.score``)."""
    agents: frozenset[str] | None = None
    """Agents it scores (None: every agent)."""
    weight: float = 0.5
    """Own reward = (1 - weight) * rule + weight * score."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.weight <= 1.0:
            raise ValueError(f"model reward weight must be in [0, 1], got {self.weight}")

    @classmethod
    def from_settings(cls, settings: RewardModelConfig | JudgeConfig,
                      score: Callable[[list[str], list[str]], list[float]]) -> ModelReward:
        """The config's reward-model section with a scorer (a replica pool's or an in-process server's ``score``)."""
        agents = frozenset(settings.agents) if settings.agents is not None else None
        return cls(score, agents, settings.weight)


def model_reward(config: ExperimentConfig, pool: RewardModelPool | None = None) -> ModelReward | None:
    """The run's model-based reward: the LLM judge through its service (``reward.judge``), or the reward model's
    replica pool (``reward_model``, ``pool``: its ``RewardModelPool``); None: neither."""
    if (judge := config.reward.judge) is not None:
        return ModelReward.from_settings(judge, JudgeScorer(judge).score)
    if pool is not None and config.reward_model is not None:
        return ModelReward.from_settings(config.reward_model, pool.score)
    return None


def score_micro_batch(env: Environment, rollouts: pa.Table, results: pa.Table,
                      advantage: Advantage | Mapping[str, Advantage] = GRPOAdvantage(),
                      team_weight: float | None = None, model_reward: ModelReward | None = None) -> pa.Table:
    """One row per turn: the turn's agent's episode reward and its group-relative advantage (``advantage``'s
    estimator, or per agent its own: ``ExperimentConfig.advantages``).

    ``team_weight`` None takes the environment's ``team_reward_weight`` (0 if it has none).
    """
    if team_weight is None:
        team_weight = hooks_of(env).team_reward_weight
    rollouts = kept_turns(rollouts)  # over-sampling's dropped episodes: no reward row, in no group's statistics
    if missing := rollouts.column("group_id").null_count:
        # The store derives the group of rows written before the column existed; a table without it is not stored.
        raise ValueError(f"{missing} rollout turns have no group_id: read stored rollouts through ExperienceStore, "
                         "or give every turn its GRPO group")
    outcomes = {row["sample_id"]: row for row in results.select(["sample_id", "outcome", "success", "observation",
                                                                  "info", "status"]).to_pylist()}
    episodes = episodes_of(rollouts.select(list(TURN_KEYS) + ["task", "prompt_text", "response_text", "observation"]))
    model_scores = _model_scores(episodes, outcomes, model_reward) if model_reward is not None else {}
    score_turns = hooks_of(env).score_turns
    keyed_rows, rewards, weights, statuses, starts, ends = [], [], [], [], [], []
    per_turn_credit = False
    for turns in episodes:
        start = datetime.now(UTC)
        episode_results = [outcomes[row["sample_id"]] for row in turns]
        turn_rewards: list[float] | None = None
        task, transcript = json.loads(turns[0]["task"]), transcript_of(turns)
        weights.extend(credit.turn_weights_of(env, task, transcript, len(turns)))  # each turn's advantage scaled
        if any(r["status"] == "failed" for r in episode_results):
            per_role, status = {}, "failed"  # a failed episode earns nothing; a failed action is scored by the env
        else:
            actions = [ActionResult(r["outcome"], r["success"], r["observation"], json.loads(r["info"]))
                       for r in episode_results]
            own = env.score(task, transcript, actions)
            if score_turns is not None:
                turn_rewards = credit.checked_turn_rewards(score_turns(task, transcript, actions), len(turns))
            if turn_rewards is not None:
                per_turn_credit = True
                team = sum(own.values()) / len(own) if own else 0.0
                turn_rewards = [team_weight * team + (1.0 - team_weight) * value for value in turn_rewards]
            for index, row in enumerate(turns):
                if row["sample_id"] in model_scores:
                    w = model_reward.weight  # type: ignore[union-attr]
                    if turn_rewards is not None:
                        turn_rewards[index] = (1.0 - w) * turn_rewards[index] + w * model_scores[row["sample_id"]]
                    own[row["role"]] = (1.0 - w) * own.get(row["role"], 0.0) + w * model_scores[row["sample_id"]]
            per_role, status = credit.assign_credit(own, team_weight), "ok"
        end = datetime.now(UTC)
        for index, row in enumerate(turns):
            keyed_rows.append(row)
            rewards.append(float(turn_rewards[index] if turn_rewards is not None else per_role.get(row["role"], 0.0)))
            statuses.append(status)
            starts.append(start)
            ends.append(end)
    rewards_array = np.asarray(rewards, dtype=np.float64)
    # Advantages are relative within one task prompt's n episodes, per agent and role (a shared policy's roles apart,
    # as AT-GRPO groups them): one label per (group, agent, role), or per (group, agent, role, turn) where the plugin
    # scores turns (each turn against the same turn of the other episodes).
    labels: dict[tuple, int] = {}
    groups = np.asarray([labels.setdefault((row["group_id"], row["agent"], row["role"])
                                           + ((row["turn"],) if per_turn_credit else ()), len(labels))
                         for row in keyed_rows])
    agents, roles = (np.asarray([row[name] for row in keyed_rows]) for name in ("agent", "role"))
    scored = advantages.ScoredRows(rewards_array, groups, agents, np.asarray([row["episode"] for row in keyed_rows]),
                                   None if np.array_equal(agents, roles) else roles)
    relative = (_relative(scored, advantage) * np.asarray(weights, dtype=np.float64)
                if keyed_rows else rewards_array)
    columns = {name: [row[name] for row in keyed_rows] for name in TURN_KEYS}
    columns.update(reward=rewards_array.astype(np.float32), advantage=relative.astype(np.float32),
                   model_score=pa.array([model_scores.get(row["sample_id"]) for row in keyed_rows], pa.float32()),
                   reward_start=starts, reward_end=ends, status=statuses, error=[None] * len(keyed_rows))
    return pa.table(columns, schema=with_agent(REWARDS))


def mean_rewards(store: ExperienceStore | RecentCommits, keys: list[MicroBatchKey]) -> dict[str, float]:
    """Mean episode reward of each agent over committed micro-batches (a step's ``keys``)."""
    tables = [store.read("rewards", key, columns=["agent", "reward"]) for key in keys]
    table = pa.concat_tables(tables).group_by("agent").aggregate([("reward", "mean")])
    return dict(zip(table.column("agent").to_pylist(), table.column("reward_mean").to_pylist()))


def _relative(scored: advantages.ScoredRows, advantage: Advantage | Mapping[str, Advantage]) -> np.ndarray:
    """Each row's advantage by its agent's estimator. Every estimator compares a row within its agent's rows only
    (groups are per agent, the agent-normalized scale is the agent's), so each agent's rows are estimated apart."""
    if not isinstance(advantage, Mapping):
        return advantages.estimator(advantage)(scored)
    relative = np.zeros_like(scored.rewards)
    for agent in np.unique(scored.agents):
        rows = scored.agents == agent
        relative[rows] = advantages.estimator(advantage[str(agent)])(advantages.ScoredRows(
            scored.rewards[rows], scored.groups[rows], scored.agents[rows], scored.episodes[rows],
            None if scored.roles is None else scored.roles[rows]))
    return relative


def _model_scores(episodes: list[list[dict]], outcomes: dict[str, dict], model_reward: ModelReward
                  ) -> dict[str, float]:
    """The model's score of each scored agent's last turn in every episode that did not fail, by sample_id;
    one call for the whole micro-batch, so the pool batches it."""
    scored = []
    for turns in episodes:
        if any(outcomes[row["sample_id"]]["status"] == "failed" for row in turns):
            continue
        last = {row["role"]: row for row in turns}  # turns are in order: the last one per role wins
        scored += [row for role, row in last.items() if model_reward.agents is None or role in model_reward.agents]
    if not scored:
        return {}
    scores = model_reward.score([row["prompt_text"] for row in scored], [row["response_text"] for row in scored])
    if len(scores) != len(scored):
        raise ValueError(f"the reward model returned {len(scores)} scores for {len(scored)} turns")
    scores = [float(s) for s in scores]  # numpy scalars and tensors' items alike
    bad = [s for s in scores if not 0.0 <= s <= 1.0]  # NaN fails this too
    if bad:
        raise ValueError(f"the reward model returned scores outside [0, 1]: {bad[:3]}")
    return {row["sample_id"]: score for row, score in zip(scored, scores)}
