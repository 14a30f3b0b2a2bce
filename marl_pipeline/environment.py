"""The environment plugin API: what a multi-agent workflow declares, and the registry that finds it.

A plugin is one module with one class satisfying :class:`Environment`, registered either through the
``marl_pipeline.environments`` entry-point group (shipped plugins, see pyproject.toml) or by calling
:func:`register_environment` (a module of the user's own, imported before the config is loaded).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any, ClassVar, Protocol

import numpy as np
from pydantic import BaseModel

ENTRY_POINT_GROUP = "marl_pipeline.environments"

Task = dict[str, Any]
"""One task prompt: JSON-serialisable, with a unique ``"id"``; the plugin owns the other keys."""


@dataclass(frozen=True)
class Turn:
    """One agent's generation inside an episode, as the environment sees it."""

    role: str
    text: str


@dataclass(frozen=True)
class ActionResult:
    """What executing one turn's action produced: recorded per turn in ``environment_results``."""

    outcome: str
    """Short machine-readable outcome, e.g. ``correct``, ``wrong``, ``unparsable``."""
    success: bool
    """Whether the action did what the turn was meant to do."""
    observation: str = ""
    """What the environment replied, shown to later turns if the plugin renders it."""
    info: dict[str, Any] = field(default_factory=dict)
    """Extra facts for inspection (parsed answer, expected answer, ...)."""


class Environment(Protocol):
    """A multi-agent workflow. Its methods must be deterministic given their arguments."""

    name: ClassVar[str]
    """Registry name used in configs."""
    turn_order: ClassVar[tuple[str, ...]]
    """Roles in the order they speak in an episode; a role may speak more than once."""
    Options: ClassVar[type[BaseModel]]
    """Pydantic model of the plugin's own options (``environment.options`` in the config)."""

    def __init__(self, options: BaseModel) -> None: ...

    def sample_tasks(self, rng: np.random.Generator, count: int) -> list[Task]:
        """Draw ``count`` task prompts."""

    def render_prompt(self, role: str, task: Task, transcript: list[Turn]) -> str:
        """The prompt ``role`` sees for its next turn: this decides who sees what."""

    def execute(self, task: Task, transcript: list[Turn]) -> list[ActionResult]:
        """Execute each turn's action of a finished episode; one result per turn."""

    def score(self, task: Task, transcript: list[Turn], results: list[ActionResult]) -> dict[str, float]:
        """Reward in [0, 1] per role for one episode (the credit assignment)."""

    def text_corpus(self, rng: np.random.Generator, count: int) -> list[str]:
        """Text the built-in tokenizer is trained on: prompts and completions of every role."""

    def warmup_examples(self, role: str, rng: np.random.Generator, count: int) -> list[tuple[str, str]]:
        """(prompt, completion) pairs for the supervised warm-up of ``role``'s base policy."""


_registered: dict[str, type] = {}


def register_environment(env_class: type) -> type:
    """Register an environment class under its ``name``; usable as a class decorator."""
    for attribute in ("name", "turn_order", "Options"):
        if not hasattr(env_class, attribute):
            raise TypeError(f"environment class {env_class.__qualname__} lacks the class attribute {attribute!r}")
    _registered[env_class.name] = env_class
    return env_class


def available_environments() -> dict[str, type]:
    """Every environment class: entry points of installed packages, then in-process registrations."""
    found: dict[str, type] = {}
    for entry in entry_points(group=ENTRY_POINT_GROUP):
        found[entry.name] = entry.load()
    found.update(_registered)
    return found


def get_environment_class(name: str) -> type:
    """Look up an environment class by name.

    Raises:
        KeyError: with a message listing the known names.
    """
    available = available_environments()
    if name not in available:
        raise KeyError(f"unknown environment {name!r}; known: {sorted(available)}")
    return available[name]


def roles_of(env_class: type) -> tuple[str, ...]:
    """The distinct roles of an environment, in first-speaking order."""
    return tuple(dict.fromkeys(env_class.turn_order))


def build_environment(name: str, options: dict[str, Any]) -> Environment:
    """Instantiate a registered environment with validated options."""
    env_class = get_environment_class(name)
    return env_class(env_class.Options.model_validate(options))
