"""The experiment resource: the validated experiment config."""

from __future__ import annotations

import dagster as dg
from pydantic import Field


class ExperimentResource(dg.ConfigurableResource):
    """One experiment YAML file, validated when first used (never at import time)."""

    config_path: str = Field(default="configs/demo.yaml", description="Experiment YAML file.")

    def load(self):
        """The validated ``ExperimentConfig``; raises ``ConfigError`` naming the bad field."""
        from marl_pipeline.config import load_config

        return load_config(self.config_path)
