"""What ``marl inspect`` shows of a stored run, as plain values: distributions, failures, sample episodes.

Reads go through ``ExperienceStore.read_stage`` with a partition filter and a column projection, so
``--step`` and ``--agent`` only open the files of that step and agent.
"""

from __future__ import annotations

import numpy as np
import pyarrow.compute as pc
import pyarrow.dataset as ds

from marl_pipeline.store.schema import STAGES

_EPISODE = ["step", "micro_batch", "episode"]


def partition_filter(step: int | None = None, agent: str | None = None) -> ds.Expression | None:
    """A pyarrow filter on the hive columns (prunes files), or None for everything."""
    terms = [ds.field("step") == step] if step is not None else []
    terms += [ds.field("agent") == agent] if agent is not None else []
    if not terms:
        return None
    expression = terms[0]
    for term in terms[1:]:
        expression = expression & term
    return expression


def distribution(values: np.ndarray, bins: int = 10) -> dict:
    """n, mean, std, min, quartiles, max and a histogram of ``bins`` equal bins (edges and counts)."""
    values = values[np.isfinite(values)]
    if not len(values):
        return {"n": 0}
    low, high = float(values.min()), float(values.max())
    counts, edges = np.histogram(values, bins=bins, range=(low, high) if high > low else (low - 0.5, high + 0.5))
    return {"n": len(values), "mean": float(values.mean()), "std": float(values.std()), "min": low,
            "p25": float(np.quantile(values, 0.25)), "p50": float(np.quantile(values, 0.5)),
            "p75": float(np.quantile(values, 0.75)), "max": high,
            "histogram": {"edges": [float(e) for e in edges], "counts": [int(c) for c in counts]}}


def inspect_run(store, run: str, step: int | None = None, agent: str | None = None) -> dict:
    """Episodes, turns and tokens per agent, reward distribution per agent, policy staleness, failures, and the
    turns of episodes over-sampling dropped (``dropped``, only when there are any)."""
    where = partition_filter(step, agent)
    rollouts = store.read_stage(run, "rollouts", filter=where,
                                columns=[*_EPISODE, "agent", "policy_version", "response_ids"])
    rewards = store.read_stage(run, "rewards", columns=[*_EPISODE, "agent", "reward"], filter=where)
    report: dict = {
        "steps": len(pc.unique(rollouts.column("step"))),
        "episodes": rollouts.group_by(_EPISODE).aggregate([]).num_rows if rollouts.num_rows else 0,
        "turns": rollouts.num_rows, "agents": {}, "failures": {},
    }
    tokens = pc.list_value_length(rollouts.column("response_ids")).to_numpy(zero_copy_only=False)
    rollout_agents = np.asarray(rollouts.column("agent").to_pylist(), dtype=object)
    reward_agents = np.asarray(rewards.column("agent").to_pylist(), dtype=object)
    reward_values = rewards.column("reward").to_numpy(zero_copy_only=False).astype(np.float64)
    for name in sorted(set(rollout_agents) | set(reward_agents)):
        mine = rollout_agents == name
        report["agents"][name] = {"turns": int(mine.sum()), "tokens": int(tokens[mine].sum()),
                                  "reward": distribution(reward_values[reward_agents == name])}
    staleness = (rollouts.column("step").to_numpy().astype(np.int64)
                 - rollouts.column("policy_version").to_numpy(zero_copy_only=False).astype(np.int64))
    values, counts = np.unique(staleness, return_counts=True)
    report["staleness"] = {int(v): int(c) for v, c in zip(values, counts)}
    for name, figures in report["agents"].items():  # each agent's own (agents.<a>.staleness bounds each apart)
        values, counts = np.unique(staleness[rollout_agents == name], return_counts=True)
        figures["staleness"] = {int(v): int(c) for v, c in zip(values, counts)}
    for stage in STAGES:
        statuses = store.read_stage(run, stage, columns=["status", "error"], filter=where)
        failed = statuses.filter(pc.not_equal(statuses.column("status"), "ok"))
        dropped = failed.filter(pc.equal(failed.column("status"), "dropped"))  # over-sampling's: not failures
        for name, rows in (("failures", failed.filter(pc.not_equal(failed.column("status"), "dropped"))),
                           ("dropped", dropped)):
            if rows.num_rows:
                errors = rows.group_by("error").aggregate([("status", "count")]).sort_by([("status_count",
                                                                                          "descending")])
                report.setdefault(name, {})[stage] = {"rows": rows.num_rows, "errors": dict(zip(
                    errors.column("error").to_pylist(), errors.column("status_count").to_pylist()))}
    return report


def sample_episodes(store, run: str, count: int, step: int | None = None, agent: str | None = None,
                    seed: int = 0) -> list[dict]:
    """``count`` episodes drawn at random (seeded), each with every agent's turns in order.

    With ``agent``, episodes are drawn among those where that agent took a turn.
    """
    if count <= 0:
        return []
    keys = store.read_stage(run, "rollouts", columns=_EPISODE, filter=partition_filter(step, agent))
    keys = keys.group_by(_EPISODE).aggregate([]).sort_by([(c, "ascending") for c in _EPISODE]).to_pylist()
    rng = np.random.default_rng(seed)
    chosen = [keys[i] for i in sorted(rng.choice(len(keys), size=min(count, len(keys)), replace=False))]
    episodes = []
    for key in chosen:
        where = (ds.field("step") == key["step"]) & (ds.field("micro_batch") == key["micro_batch"])
        turns = _episode_turns(store, run, where, key["episode"])
        first = turns[0] if turns else {}
        episodes.append({**key, "task_id": first.get("task_id"), "group_id": first.get("group_id"), "turns": turns})
    return episodes


def _episode_turns(store, run: str, where: ds.Expression, episode: int) -> list[dict]:
    where = where & (ds.field("episode") == episode)
    rollouts = store.read_stage(run, "rollouts", filter=where, columns=[
        "sample_id", "task_id", "group_id", "agent", "role", "turn", "policy_version", "prompt_text", "response_text",
        "observation", "finish_reason", "status", "error"])
    # ``reply``: the environment's reply during rollout (observe); ``observation``: its action's result, below.
    by_sample: dict[str, dict] = {}
    for row in rollouts.to_pylist():
        row["reply"] = row.pop("observation")
        by_sample[row["sample_id"]] = {**row, "reward": None, "outcome": None, "observation": None}
    for stage, columns in (("rewards", ["sample_id", "reward", "advantage"]),
                           ("environment_results", ["sample_id", "outcome", "observation"])):
        for row in store.read_stage(run, stage, filter=where, columns=columns).to_pylist():
            if row["sample_id"] in by_sample:
                by_sample[row["sample_id"]].update(row)
    return sorted(by_sample.values(), key=lambda row: row["turn"])


def text_histogram(histogram: dict, width: int = 20) -> list[tuple[str, int, str]]:
    """(bin label, count, bar) rows of a ``distribution`` histogram, for a terminal or Markdown."""
    edges, counts = histogram["edges"], histogram["counts"]
    top = max(counts) or 1
    return [(f"[{edges[i]:.3g}, {edges[i + 1]:.3g}{']' if i == len(counts) - 1 else ')'}", count,
             "█" * round(width * count / top)) for i, count in enumerate(counts)]

