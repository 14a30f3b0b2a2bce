"""Dagster layer: assets, jobs and schedules over marl_pipeline (see assets.definitions.defs)."""
