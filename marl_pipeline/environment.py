"""The environment plugin API: what a multi-agent workflow declares, and the registry that finds it.

A plugin is one module with one class satisfying :class:`Environment`, registered either through the
``marl_pipeline.environments`` entry-point group (shipped plugins, see pyproject.toml) or by calling
:func:`register_environment` (a module of the user's own, imported before the config is loaded).
docs/environments.md is the guide.

Optional methods and attributes, and which config features need which: ``marl_pipeline.hooks.HOOKS`` (one
table), resolved for the engine by ``hooks.hooks_of``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any, ClassVar, Literal, Protocol, TypedDict

import numpy as np
from pydantic import BaseModel

# A plugin's calls to services outside the cluster, under the run's quotas (external.py).
from marl_pipeline.external import ServiceClient, ServiceError, service  # noqa: F401

ENTRY_POINT_GROUP = "marl_pipeline.environments"

Task = dict[str, Any]
"""One task prompt: JSON-serialisable, with a unique ``"id"``; the plugin owns the other keys."""


class ChatMessage(TypedDict):
    """One message of a chat prompt, as the agent's chat template reads it."""

    role: Literal["system", "user", "assistant"]
    content: str


ChatMessages = list[ChatMessage]
"""A chat prompt: the conversation the agent is shown, oldest message first, ending with a system or user
message for it to answer (docs/environments.md, "Chat prompts")."""

Prompt = str | ChatMessages
"""What ``render_prompt`` returns: plain text (the engine tokenizes it as is) or chat messages (the agent's
own tokenizer applies its chat template, once; later turns of the agent extend those ids)."""


@dataclass(frozen=True)
class Turn:
    """One agent's generation inside an episode, as the environment sees it."""

    role: str
    text: str
    observation: str | None = None
    """The environment's reply to this turn (``observe``), if the plugin gives one."""


@dataclass(frozen=True)
class Rehearsal:
    """A warm-up completion to hold, not teach: along its tokens the loss is the KL from the model as warm-up
    started, as for a ``None`` completion (whose path is sampled instead), plus the squared change of its own tokens'
    log-probabilities (``bootstrap/warmup.py``). A plugin gives one to hold a path that sampling rarely finds: a base
    model's rare right answer."""

    text: str


MAX_ACTION_BYTES = 64 * 1024
"""Default payload limit of an action; a plugin may set ``max_action_bytes``."""


@dataclass(frozen=True)
class Action:
    """What one turn asks the environment to execute: produced by a plugin's ``actions``, run by the pool."""

    kind: str
    """What to do: ``answer`` (check it), ``code`` (run it in the sandbox), ``tool`` (call a tool), ..."""
    payload: str
    """The turn's text to act on; must be a UTF-8 ``str`` within the payload limit, or the action is malformed."""
    expected_cost: float = 1.0
    """Relative expected run time; the pool runs cheaper actions first."""
    context: dict[str, Any] = field(default_factory=dict)
    """The plugin's own facts for ``run_action`` (expected answer, hidden tests, ...); JSON-serialisable."""


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

    def render_prompt(self, role: str, task: Task, transcript: list[Turn]) -> Prompt:
        """The prompt ``role`` sees for its next turn: this decides who sees what.

        Either a ``str`` (the engine tokenizes it as it is, no template) or :data:`ChatMessages`. With messages,
        the agent's tokenizer applies its chat template once and those ids are what the engine samples from
        and the trainer trains on. When the same role speaks again in the episode, its messages must start with
        the messages it was shown last time plus ``{"role": "assistant", "content": <its reply's text>}``;
        only the messages after those are tokenized, appended to the ids of its previous prompt and reply, so
        nothing the agent saw or said is ever re-tokenized from text. A role's turns in one episode are all
        strings or all messages; messages need a tokenizer with a chat template (the built-in tiny model has
        none)."""

    def execute(self, task: Task, transcript: list[Turn]) -> list[ActionResult]:
        """Execute each turn's action of a finished episode; one result per turn."""

    def score(self, task: Task, transcript: list[Turn], results: list[ActionResult]) -> dict[str, float]:
        """Reward in [0, 1] per role for one episode (the credit assignment)."""


@dataclass(frozen=True)
class EvaluationCase:
    """One held-out question for one agent: the episode up to that agent's turn, and what a right answer is.

    The plugin chooses the earlier turns, so an agent is tested on its own skill: a verifier is shown right
    and wrong answers in the proportions the plugin picks, whatever the solver would have said.
    """

    task: Task
    transcript: list[Turn]
    """The turns before the evaluated agent's (empty for the first speaker)."""
    label: str
    """What the plugin's ``evaluate`` compares the answer with (the expected sum, ``yes``/``no``...)."""
    turns: int = 1
    """How many turns in a row the agent takes (a verifier that works the question out before its verdict: 2).
    Each of its replies joins the transcript before its next turn; the last one is the evaluated response."""

    def __post_init__(self) -> None:
        if self.turns < 1:
            raise ValueError(f"EvaluationCase.turns is {self.turns}: an evaluated agent takes at least one turn")


class EvaluatedEnvironment(Environment, Protocol):
    """An environment that measures each agent on held-out cases (the ``evaluations`` of a run)."""

    def evaluation_cases(self, role: str, rng: np.random.Generator, count: int) -> list[EvaluationCase]:
        """``count`` held-out cases for ``role``. ``rng`` comes from a seed stream that training never draws
        from; a plugin whose task space is small should also keep its evaluation tasks apart."""

    def evaluate(self, role: str, cases: list[EvaluationCase], responses: list[str]) -> dict[str, float]:
        """Metrics of ``role``'s greedy responses to ``cases``, each in [0, 1], higher is better; the first one
        is the agent's headline metric (accuracy for a solver, balanced accuracy for a verifier)."""

    def answer_of(self, role: str, response: str) -> str:
        """The answer a response gives, normalised (for the answer entropy and the collapse check)."""


TEAM = "team"
"""The agent name of the team's rows in a run's evaluations (stages/team.py): no plugin may have a role of that
name."""


class TeamEnvironment(EvaluatedEnvironment, Protocol):
    """An environment whose agents are also measured as a team: each of the answering role's held-out cases is played
    as ``n`` sampled episodes of the whole workflow, and the plugin says which episode's answer the team returns
    (stages/team.py compares it with the answering role alone: its first sample, and the majority of its n). The
    answering role is the first speaker, unless the plugin names another (``answering_role``: the last step of a
    task the roles split)."""

    def team_choice(self, task: Task, episodes: list[list[Turn]]) -> int:
        """The index of the episode whose answering role's answer the team returns (a verifier's pick: see
        :func:`accepted_majority`)."""


def accepted_majority(answers: list[str], accepted: list[bool]) -> int:
    """The episode a verifier's verdicts choose: the first one giving the most frequent answer among the accepted
    episodes (ties: the answer accepted first); with none accepted, episode 0 (what the solver alone returns).

    Args:
        answers: each episode's answer, normalised (``answer_of``).
        accepted: whether the verifier accepted that episode's answer.
    """
    if len(answers) != len(accepted):
        raise ValueError(f"{len(answers)} answers against {len(accepted)} verdicts")
    votes = Counter(answer for answer, ok in zip(answers, accepted) if ok)
    if not votes:
        return 0
    best = max(votes.values())
    return next(i for i, (answer, ok) in enumerate(zip(answers, accepted)) if ok and votes[answer] == best)


class WarmupEnvironment(Environment, Protocol):
    """An environment whose agents can start from the built-in model or be warmed up (``hooks.HOOKS`` says which
    config needs which)."""

    def text_corpus(self, rng: np.random.Generator, count: int) -> list[str]:
        """Text the built-in tokenizer is trained on: prompts and completions of every role."""

    def warmup_examples(self, role: str, rng: np.random.Generator,
                        count: int) -> list[tuple[str | ChatMessages, str | None]]:
        """(prompt, completion) pairs for the supervised warm-up of ``role``'s base policy. A prompt given as chat
        messages is rendered with the agent's chat template, as rollout renders it. A ``None`` completion rehearses
        the policy's own reply to the prompt, sampled before warm-up as rollout samples: teaching one turn then
        leaves that one as it was (``bootstrap/warmup.py``)."""


class ActionEnvironment(Environment, Protocol):
    """An environment whose turns' actions run one by one on the action pool (instead of ``execute``)."""

    def actions(self, task: Task, transcript: list[Turn]) -> list[Action | None]:
        """The action each turn of a finished episode asks for (None: the turn asks for nothing)."""

    def run_action(self, action: Action) -> ActionResult:
        """Execute one action; runs on a pool worker, so it must not rely on state set up in the driver."""


def validate_action(action: object, max_bytes: int = MAX_ACTION_BYTES) -> str | None:
    """Why ``action`` cannot run (wrong type, oversized or non-UTF-8 payload), or None when it can."""
    if not isinstance(action, Action):
        return f"wrong type: expected Action or None, got {type(action).__name__}"
    payload = action.payload
    if isinstance(payload, bytes):
        try:
            payload.decode("utf-8")
        except UnicodeDecodeError as error:
            return f"invalid UTF-8 in payload at byte {error.start}"
        return "wrong type: payload is bytes, expected str"
    if not isinstance(payload, str):
        return f"wrong type: payload is {type(payload).__name__}, expected str"
    try:
        size = len(payload.encode("utf-8"))
    except UnicodeEncodeError as error:  # lone surrogates: text that came from undecodable bytes
        return f"invalid UTF-8 in payload at character {error.start}"
    if size > max_bytes:
        return f"oversized payload: {size} bytes > {max_bytes}"
    return None


_registered: dict[str, type] = {}


def register_environment(env_class: type) -> type:
    """Register an environment class under its ``name``; usable as a class decorator."""
    for attribute in ("name", "turn_order", "Options"):
        if not hasattr(env_class, attribute):
            raise TypeError(f"environment class {env_class.__qualname__} lacks the class attribute {attribute!r}")
    _registered[env_class.name] = env_class
    return env_class


def available_environments() -> dict[str, type]:
    """Every environment class that loads: entry points of installed packages, then in-process registrations. A
    plugin that fails to import is left out (:func:`get_environment_class` says why when a config names it), so one
    broken package breaks only the runs that use it."""
    found: dict[str, type] = {}
    for entry in entry_points(group=ENTRY_POINT_GROUP):
        try:
            found[entry.name] = entry.load()
        except Exception:
            continue
    found.update(_registered)
    return found


def get_environment_class(name: str) -> type:
    """Look up an environment class by name, loading only that plugin.

    Raises:
        KeyError: with a message listing the known names, or why the named plugin does not load.
    """
    if name in _registered:
        return _registered[name]
    for entry in entry_points(group=ENTRY_POINT_GROUP, name=name):
        try:
            return entry.load()
        except Exception as error:
            raise KeyError(f"environment {name!r} ({entry.value}) fails to load: {type(error).__name__}: {error}"
                           ) from error
    raise KeyError(f"unknown environment {name!r}; known: {sorted(available_environments())}")


def roles_of(env_class: type) -> tuple[str, ...]:
    """The distinct roles of an environment, in first-speaking order."""
    return tuple(dict.fromkeys(env_class.turn_order))


def build_environment(name: str, options: dict[str, Any]) -> Environment:
    """Instantiate a registered environment with validated options."""
    env_class = get_environment_class(name)
    return env_class(env_class.Options.model_validate(options))
