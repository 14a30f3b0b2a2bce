"""What the adapters of the ecosystem's packages (textarena_games.py, verifiers_tasks.py) share: a package of the
``environments`` extra imported where it is used, with an error that says how to install it."""

from __future__ import annotations

import importlib
from types import ModuleType


def extra(module: str, what: str) -> ModuleType:
    """``module``, imported; a ``ValueError`` naming what needs it and how to install it when it is missing."""
    try:
        return importlib.import_module(module)
    except ImportError as error:  # the extra is not installed
        raise ValueError(f"{what} need the {module.partition('.')[0]} package: install the project's `environments` "
                         f"extra (make setup does)") from error
