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
