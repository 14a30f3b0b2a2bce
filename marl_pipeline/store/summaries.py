"""Plain-value summaries of stage partitions and runs, shown as Dagster metadata and by ``marl inspect``."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc


def stage_summary(stage: str, table: pa.Table) -> dict[str, float | int | str]:
    """Rows, tokens, rewards per agent, policy versions and (policy updates) the engine-vs-trainer mismatch and the
    rows dynamic sampling left out, per agent, of one committed stage partition."""
    summary: dict[str, float | int | str] = {"rows": table.num_rows}
    if "response_ids" in table.column_names:
        summary["tokens"] = int(pc.sum(pc.list_value_length(table.column("response_ids"))).as_py() or 0)
    if "policy_version" in table.column_names and table.num_rows:
        summary["policy_version"] = int(pc.max(table.column("policy_version")).as_py())
    if "tokens" in table.column_names and stage == "policy_updates":
        summary["tokens"] = int(pc.sum(table.column("tokens")).as_py() or 0)
    if "reward" in table.column_names and table.num_rows:
        for agent, mean in _mean_by_agent(table, "reward").items():
            summary[f"mean_reward/{agent}"] = round(mean, 4)
    if "model_score" in table.column_names and table.column("model_score").null_count < table.num_rows:
        for agent, mean in _mean_by_agent(table.filter(pc.is_valid(table.column("model_score"))),
                                          "model_score").items():
            summary[f"mean_model_score/{agent}"] = round(mean, 4)
    if stage == "policy_updates":
        for column in ("mismatch_abs_logprob", "mismatch_ratio_std"):
            if column in table.column_names and table.column(column).null_count < table.num_rows:
                for agent, mean in _mean_by_agent(table.filter(pc.is_valid(table.column(column))), column).items():
                    summary[f"{column}/{agent}"] = round(mean, 6)
        if "dropped_rows" in table.column_names and table.column("dropped_rows").null_count < table.num_rows:
            dropped = table.filter(pc.is_valid(table.column("dropped_rows")))
            for agent, total in zip(dropped.column("agent").to_pylist(), dropped.column("dropped_rows").to_pylist()):
                summary[f"dropped_rows/{agent}"] = int(total)  # one policy-update row per agent and micro-batch
    if "success" in table.column_names and table.num_rows:
        summary["success_rate"] = round(float(pc.mean(table.column("success").cast(pa.float64())).as_py()), 4)
    if "status" in table.column_names:
        dropped = int(pc.sum(pc.equal(table.column("status"), "dropped").cast(pa.int64())).as_py() or 0)
        failed = int(pc.sum(pc.not_equal(table.column("status"), "ok").cast(pa.int64())).as_py() or 0)
        summary["failed_rows"] = failed - dropped
        if dropped:  # the turns of episodes over-sampling cut (pipeline.rollout.oversample): not failures
            summary["dropped_turns"] = dropped
    return summary


def _mean_by_agent(table: pa.Table, column: str) -> dict[str, float]:
    grouped = table.group_by("agent").aggregate([(column, "mean")])
    return dict(zip(grouped.column("agent").to_pylist(), grouped.column(f"{column}_mean").to_pylist()))


def reward_table(rewards: pa.Table) -> dict[int, dict[str, float]]:
    """Mean reward per step and agent (from a run's ``rewards`` dataset), steps in order."""
    if not rewards.num_rows:
        return {}
    grouped = rewards.group_by(["step", "agent"]).aggregate([("reward", "mean")])
    table: dict[int, dict[str, float]] = {}
    for step, agent, mean in zip(*(grouped.column(c).to_pylist() for c in ("step", "agent", "reward_mean"))):
        table.setdefault(step, {})[agent] = mean
    return dict(sorted(table.items()))
