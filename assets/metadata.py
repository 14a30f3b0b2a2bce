"""Dagster metadata of stage partitions and policy versions (from marl_pipeline's plain summaries)."""

from __future__ import annotations

from pathlib import Path

import dagster as dg
import pyarrow as pa
import pyarrow.compute as pc

from assets.previews import episodes_markdown
from marl_pipeline.store.summaries import stage_summary

_SAMPLE_TURNS = 3
_SAMPLE_COLUMNS = ("sample_id", "agent", "turn", "policy_version", "response_text", "observation", "outcome",
                   "success", "reward", "model_score", "advantage", "tokens", "loss_sum", "status")
"""Columns shown in a partition's sample-turns table, where the stage has them."""


def stage_metadata(stage: str, path: Path | str, seconds: float, table: pa.Table,
                   rollouts: pa.Table | None = None) -> dict[str, dg.MetadataValue]:
    """Rows, tokens, mean reward per agent, policy version, stage latency, storage path, column schema,
    a few sample turns as a table, for rewards a reward histogram, and the first episodes as a conversation: for
    rollouts from the table itself, for rewards (with each turn's reward) given the micro-batch's ``rollouts``."""
    from marl_pipeline.store.schema import SCHEMA_VERSION

    metadata: dict[str, dg.MetadataValue] = {
        "dagster/row_count": dg.MetadataValue.int(table.num_rows),
        "stage_latency_s": dg.MetadataValue.float(round(seconds, 4)),
        "path": dg.MetadataValue.path(str(path)),
        "schema_version": dg.MetadataValue.int(SCHEMA_VERSION),
        "dagster/column_schema": dg.MetadataValue.table_schema(_table_schema(table.schema)),
    }
    for name, value in stage_summary(stage, table).items():
        if name == "rows":
            continue
        metadata[name] = dg.MetadataValue.int(value) if isinstance(value, int) else dg.MetadataValue.float(value)
    metadata["sample_turns"] = _sample_turns(table)
    if "reward" in table.column_names and table.num_rows:
        metadata["reward_histogram"] = dg.MetadataValue.md(_reward_histogram_md(table))
    if stage == "rollouts":
        metadata["episodes"] = dg.MetadataValue.md(episodes_markdown(table))
    elif stage == "rewards" and rollouts is not None:
        metadata["episodes"] = dg.MetadataValue.md(episodes_markdown(rollouts, scores=table))
    return metadata


def _table_schema(schema: pa.Schema) -> dg.TableSchema:
    return dg.TableSchema(columns=[dg.TableColumn(field.name, str(field.type)) for field in schema])


def _sample_turns(table: pa.Table) -> dg.MetadataValue:
    """The first few rows, short columns only (texts cut to 80 characters), as a Dagster table."""
    head = table.slice(0, _SAMPLE_TURNS)
    if "response_ids" in head.column_names:
        head = head.append_column("tokens", pc.list_value_length(head.column("response_ids")))
    head = head.select([name for name in _SAMPLE_COLUMNS if name in head.column_names])
    records = []
    for row in head.to_pylist():
        records.append(dg.TableRecord({name: value[:80] if isinstance(value, str) else value
                                       for name, value in row.items() if value is not None}))
    return dg.MetadataValue.table(records, schema=_table_schema(head.schema))


def _reward_histogram_md(table: pa.Table) -> str:
    # A text histogram, not a PNG: the train job logs one per partition and a plot costs ~50 ms to render.
    import numpy as np

    from marl_pipeline.store.inspection import distribution, text_histogram

    lines = ["| agent | reward bin | turns | |", "| --- | --- | ---: | --- |"]
    agents = np.asarray(table.column("agent").to_pylist(), dtype=object)
    rewards = table.column("reward").to_numpy(zero_copy_only=False).astype(np.float64)
    for agent in sorted(set(agents)):
        summary = distribution(rewards[agents == agent], bins=5)
        if summary["n"]:
            lines += [f"| {agent} | {label} | {count} | {bar} |"
                      for label, count, bar in text_histogram(summary["histogram"], width=10)]
    return "\n".join(lines)


def run_report(finished, timeline) -> tuple[dict, dict[str, dg.MetadataValue]]:
    """Run-level figures of a launch (throughput, busy fractions, efficiency, staleness), as values and metadata."""
    from marl_pipeline.run.pipeline_metrics import pipeline_report

    spans, plan = timeline.spans, finished.plan
    report = pipeline_report(spans, steps=plan.last_step - plan.first_step + 1, episodes=timeline.episodes,
                             tokens=timeline.tokens, started=finished.started, ended=finished.ended)
    report["staleness_histogram"] = {str(k): v for k, v in timeline.staleness.items()}
    metadata: dict[str, dg.MetadataValue] = {
        name: dg.MetadataValue.float(value) for name, value in report.items() if isinstance(value, float)}
    metadata["staleness_histogram"] = dg.MetadataValue.json(report["staleness_histogram"])
    if timeline.step_times:  # step time: between consecutive step ends; span: a step's first rollout to its commit
        _, seconds, spans = zip(*timeline.step_times)
        report["mean_step_seconds"] = sum(seconds) / len(seconds)
        report["mean_step_span_seconds"] = sum(spans) / len(spans)
        metadata["step_times"] = dg.MetadataValue.md(
            "| step | step time (s) | first rollout to commit (s) |\n| ---: | ---: | ---: |\n"
            + "\n".join(f"| {step} | {second:.2f} | {span:.2f} |" for step, second, span in timeline.step_times))
        metadata["mean_step_seconds"] = dg.MetadataValue.float(report["mean_step_seconds"])
        metadata["mean_step_span_seconds"] = dg.MetadataValue.float(report["mean_step_span_seconds"])
    metadata["resumed"] = dg.MetadataValue.bool(plan.resumed)
    metadata["placement"] = dg.MetadataValue.json(finished.placement.summary())
    return report, metadata


def run_plots(store, run: str, finished=None, timeline=None) -> dict[str, bytes]:
    """The run's plots (alt text -> PNG): reward per agent per step and staleness per step over the run's whole
    lineage (read from the store, so a continued run shows its earlier launches too), held-out evaluation per
    policy version when the run was evaluated, and the stage activity of the launch that just finished (its live
    timeline)."""
    from assets.plots import activity_png, evaluation_png, reward_per_step_png, staleness_png
    from marl_pipeline.run.evaluations import evaluation_history
    from marl_pipeline.store.summaries import reward_table

    plots: dict[str, bytes] = {}
    if by_step := reward_table(store.read_stage(run, "rewards", columns=["step", "agent", "reward"])):
        plots["reward per step"] = reward_per_step_png(by_step, f"mean reward per agent per step, run {run}")
    rollouts = store.read_stage(run, "rollouts", columns=["step", "policy_version"])
    if rollouts.num_rows:
        staleness = pc.subtract(rollouts.column("step").cast("int64"), rollouts.column("policy_version").cast("int64"))
        counts = pa.table({"step": rollouts.column("step"), "staleness": staleness}).group_by(
            ["step", "staleness"]).aggregate([("step", "count")])
        by_staleness: dict[int, dict[int, int]] = {}
        for step, stale, count in zip(*(counts.column(c).to_pylist() for c in ("step", "staleness", "step_count"))):
            by_staleness.setdefault(step, {})[stale] = count
        plots["staleness per step"] = staleness_png(
            by_staleness, f"turns per step by staleness (step - policy version), run {run}")
    if history := evaluation_history(store, run):
        plots["held-out evaluation"] = evaluation_png(history, f"held-out evaluation, run {run}")
    if timeline is not None and timeline.spans:
        plots["stage activity"] = activity_png(timeline.spans, finished.started,
                                                    f"stage activity of the last launch, run {run}")
    return plots
