"""What an estimator gets (:class:`ScoredRows`), and per-group statistics broadcast back to each row without a
Python loop over rows."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ScoredRows:
    """A micro-batch's turn rows once scored (the reward stage produces them, an estimator consumes them): arrays
    of one element per row."""

    rewards: np.ndarray
    """float64: the row's reward (its agent's, or its turn's where the plugin scores turns)."""
    groups: np.ndarray
    """The label of the group the row is compared within: a task prompt's episodes, per agent and role (and per
    turn where the plugin scores turns)."""
    agents: np.ndarray
    """The row's agent."""
    episodes: np.ndarray
    """The row's episode: an agent that speaks several times has several rows of one episode in a group."""
    roles: np.ndarray | None = None
    """The row's role, where an agent plays several (a shared policy; None: each agent its own role): an estimator
    that scales by an agent's rewards scales each role's apart, as AT-GRPO normalizes per role."""

    def players(self) -> np.ndarray:
        """The label of the rows an agent-wide statistic spans: the agent's, per role where it plays several."""
        return self.agents if self.roles is None else labels(self.agents, self.roles)


def labels(*columns: np.ndarray) -> np.ndarray:
    """0..k-1 per row for the distinct combinations of ``columns``."""
    codes = [np.unique(column, return_inverse=True)[1].reshape(-1) for column in columns]
    combined = codes[0].astype(np.int64)
    for code in codes[1:]:
        combined = combined * (int(code.max(initial=0)) + 1) + code
    return np.unique(combined, return_inverse=True)[1].reshape(-1)


def group_sum(values: np.ndarray, groups: np.ndarray) -> np.ndarray:
    """The sum of each row's group, per row."""
    index = labels(groups)
    return np.bincount(index, weights=values)[index]


def group_size(groups: np.ndarray) -> np.ndarray:
    """The number of rows in each row's group, per row."""
    index = labels(groups)
    return np.bincount(index)[index].astype(np.float64)


def group_mean(values: np.ndarray, groups: np.ndarray) -> np.ndarray:
    """The mean of each row's group, per row."""
    return _mean(values, labels(groups))


def group_std(values: np.ndarray, groups: np.ndarray) -> np.ndarray:
    """The population std (numpy's default, ddof 0) of each row's group, per row."""
    index = labels(groups)  # once for both means
    centred = values - _mean(values, index)
    return np.sqrt(_mean(centred * centred, index))


def _mean(values: np.ndarray, index: np.ndarray) -> np.ndarray:
    return (np.bincount(index, weights=values) / np.bincount(index))[index]
