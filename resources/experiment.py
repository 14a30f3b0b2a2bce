"""The experiment resource: the validated experiment config, from a YAML file or inline, with run-config overrides.

No ``from __future__ import annotations``: Dagster reads the ``overrides`` field's evaluated annotation to build
its config schema.
"""

import os
from typing import Any

import dagster as dg
from pydantic import Field

from resources.overrides import ExperimentOverrides, override_data, set_fields

DEFAULT_CONFIG_PATH = "configs/demo.yaml"


def default_config_path() -> str:
    """The experiment of a run given neither path nor inline experiment: the ``retrain`` schedule's and sensor's, and
    the launchpad's default. ``MARL_EXPERIMENT`` picks it per deployment (read when used, never at import)."""
    return os.environ.get("MARL_EXPERIMENT") or DEFAULT_CONFIG_PATH


class ExperimentResource(dg.ConfigurableResource):
    """The experiment a run trains: ``config_path`` or ``experiment`` (inline), then ``overrides`` on top.

    Validated when a run's resources start (before any op), and again wherever it is loaded: an invalid field
    fails the run before anything is written, with a message naming the field.
    """

    config_path: str | None = Field(default=None, description="Experiment YAML file (default: $MARL_EXPERIMENT, else "
                                                              f"{DEFAULT_CONFIG_PATH}; unused with `experiment`).")
    experiment: dict[str, Any] | None = Field(default=None, description="The whole experiment inline, as in its YAML "
                                                                        "file, instead of `config_path`.")
    overrides: ExperimentOverrides | None = Field(
        default=None, description="Settings replacing the experiment's, nested like its YAML file "
                                  "(e.g. `pipeline: {steps: 5}`, `every_agent: {trainer: {lr: 0.0005}}`, `seed: 1`).")

    def setup_for_execution(self, context: dg.InitResourceContext) -> None:
        self.load()  # fail the run here, before any op touches the store, when the experiment is invalid

    def run_config(self) -> dict[str, Any]:
        """Run config that configures a run's ``experiment`` resource as this one is (what a sensor requests)."""
        fields = {"config_path": self.config_path, "experiment": self.experiment,
                  "overrides": set_fields(self.overrides)}
        return {"resources": {"experiment": {"config": {k: v for k, v in fields.items() if v is not None}}}}

    def load(self):
        """The validated ``ExperimentConfig``; raises ``ConfigError`` naming the bad field."""
        from marl_pipeline.config import parse_config

        data, source = self.data()
        return parse_config(data, source=source)

    def data(self) -> tuple[dict[str, Any], str]:
        """The experiment's mapping as its file nests it, overrides applied, not yet validated, and where it came
        from (what a search of allocations varies); raises ``ConfigError`` where it is no mapping."""
        from marl_pipeline.config import ConfigError, apply_overrides, read_config_data

        if self.experiment is not None and self.config_path is not None:
            raise ConfigError("experiment resource: give `config_path` or `experiment` (inline), not both")
        if self.experiment is not None:
            data, source = self.experiment, "(the run config's inline experiment)"
        else:
            path = self.config_path or default_config_path()
            data, source = read_config_data(path), path
        if not isinstance(data, dict):
            raise ConfigError(f"invalid config {source}: expected a mapping at the top level")
        overrides = override_data(self.overrides, agents=list(data.get("agents") or {}))
        if overrides:
            data, source = apply_overrides(data, overrides), f"{source} with the run config's overrides"
        return data, source
