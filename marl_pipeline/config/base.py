"""What every config model shares: strictness, the error type, the built-in model's name."""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, model_validator

BUILTIN_TINY = "builtin:tiny"
"""The built-in tiny model (built locally, no download): the default of every model field."""


class ConfigError(ValueError):
    """A config file is invalid; the message names the offending field."""


class StrictModel(BaseModel):
    # Attribute docstrings become field descriptions: the Dagster launchpad shows them beside each override.
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)
    removed_keys: ClassVar[dict[str, str]] = {}
    """Keys an older version took, each with what to write instead: refused with that message, not as unknown."""

    @model_validator(mode="before")
    @classmethod
    def _refuse_removed_keys(cls, data: Any) -> Any:
        if isinstance(data, dict) and (removed := [key for key in cls.removed_keys if key in data]):
            raise ValueError(cls.removed_keys[removed[0]])
        return data


