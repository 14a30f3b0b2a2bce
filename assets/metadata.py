"""Dagster metadata of stage partitions and policy versions (from marl_pipeline's plain summaries)."""

from __future__ import annotations

from pathlib import Path

import dagster as dg
import pyarrow as pa

from marl_pipeline.summaries import stage_summary


def stage_metadata(stage: str, path: Path, seconds: float, table: pa.Table) -> dict[str, dg.MetadataValue]:
    """Rows, tokens, mean reward per agent, policy version, stage latency and storage path."""
    metadata: dict[str, dg.MetadataValue] = {
        "dagster/row_count": dg.MetadataValue.int(table.num_rows),
        "stage_latency_s": dg.MetadataValue.float(round(seconds, 4)),
        "path": dg.MetadataValue.path(str(path)),
    }
    for name, value in stage_summary(stage, table).items():
        if name == "rows":
            continue
        metadata[name] = dg.MetadataValue.int(value) if isinstance(value, int) else dg.MetadataValue.float(value)
    return metadata


def run_report(config, finished, events) -> tuple[dict, dict[str, dg.MetadataValue]]:
    """Run-level figures of a launch (throughput, busy fractions, efficiency, staleness) and their plot."""
    import base64

    from marl_pipeline.orchestrator import PolicyCommitted, StageCommitted
    from marl_pipeline.pipeline_metrics import Span, activity_plot_png, pipeline_report, staleness_histogram

    spans, episodes, tokens, steps, versions = [], 0, 0, [], []
    for event in events:
        if isinstance(event, StageCommitted):
            t = event.timing
            spans.append(Span(event.stage, event.key.step, event.key.micro_batch, t.enqueued, t.started, t.ended))
            if event.stage == "rollouts":
                table = event.table
                episodes += len(set(table.column("episode").to_pylist()))
                tokens += sum(len(ids) for ids in table.column("response_ids").to_pylist())
                steps += [event.key.step] * table.num_rows
                versions += table.column("policy_version").to_pylist()
        elif isinstance(event, PolicyCommitted):
            t = event.timing
            spans.append(Span("optimizer_step", event.step, -1, t.enqueued, t.started, t.ended))
    plan = finished.plan
    report = pipeline_report(spans, steps=plan.last_step - plan.first_step + 1, episodes=episodes, tokens=tokens,
                             started=finished.started, ended=finished.ended)
    histogram = staleness_histogram(steps, versions)
    report["staleness_histogram"] = {str(k): v for k, v in histogram.items()}
    metadata: dict[str, dg.MetadataValue] = {
        name: dg.MetadataValue.float(value) for name, value in report.items() if isinstance(value, float)}
    metadata["staleness_histogram"] = dg.MetadataValue.json(report["staleness_histogram"])
    metadata["resumed"] = dg.MetadataValue.bool(plan.resumed)
    if spans:
        png = base64.b64encode(activity_plot_png(spans, finished.started)).decode()
        metadata["stage_activity"] = dg.MetadataValue.md(f"![stage activity](data:image/png;base64,{png})")
    return report, metadata
