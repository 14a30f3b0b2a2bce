"""What every config model shares: strictness, the error type, the built-in model's name."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

BUILTIN_TINY = "builtin:tiny"
"""The built-in tiny model (built locally, no download): the default of every model field."""


class ConfigError(ValueError):
    """A config file is invalid; the message names the offending field."""


class StrictModel(BaseModel):
    # Attribute docstrings become field descriptions: the Dagster launchpad shows them beside each override.
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


