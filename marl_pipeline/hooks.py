"""The plugin surface in one place: every method and attribute an environment may define (:data:`HOOKS`), which
of them a run needs given its config (:func:`missing_hooks`), and a plugin's optional hooks resolved once per
instance (:func:`hooks_of`). The engine reads a plugin's optional hooks only through :func:`hooks_of`;
docs/environments.md documents :data:`HOOKS` (a test compares the two).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from marl_pipeline.environment import MAX_ACTION_BYTES

Need = Literal["always", "without actions", "with actions", "built-in model", "warm-up", "built-in reward model",
               "evaluation", "optional"]


@dataclass(frozen=True)
class Hook:
    """One method or attribute of the plugin surface."""

    name: str
    signature: str
    """How it is called (or, for an attribute, its type)."""
    need: Need
    """When a run needs it: always; ``execute`` unless the plugin has ``actions`` + ``run_action``; the others only
    when the config uses what they serve (an agent on the built-in model, a warm-up, the built-in reward model,
    held-out evaluation)."""


HOOKS: tuple[Hook, ...] = (
    Hook("sample_tasks", "sample_tasks(rng, count) -> list[Task]", "always"),
    Hook("render_prompt", "render_prompt(role, task, transcript) -> str | ChatMessages", "always"),
    Hook("score", "score(task, transcript, results) -> dict[str, float]", "always"),
    Hook("execute", "execute(task, transcript) -> list[ActionResult]", "without actions"),
    Hook("actions", "actions(task, transcript) -> list[Action | None]", "with actions"),
    Hook("run_action", "run_action(action) -> ActionResult", "with actions"),
    Hook("text_corpus", "text_corpus(rng, count) -> list[str]", "built-in model"),
    Hook("warmup_examples", "warmup_examples(role, rng, count) -> list[tuple[str | ChatMessages, str | None]]",
         "warm-up"),
    Hook("reward_examples", "reward_examples(rng, count) -> list[tuple[str, str, float]]", "built-in reward model"),
    Hook("evaluation_cases", "evaluation_cases(role, rng, count) -> list[EvaluationCase]", "evaluation"),
    Hook("evaluate", "evaluate(role, cases, responses) -> dict[str, float]", "evaluation"),
    Hook("answer_of", "answer_of(role, response) -> str", "evaluation"),
    Hook("team_choice", "team_choice(task, episodes) -> int", "optional"),
    Hook("answering_role", "answering_role: str", "optional"),
    Hook("episode_task", "episode_task(task, trajectory) -> Task", "optional"),
    Hook("observe", "observe(role, task, transcript) -> str | None", "optional"),
    Hook("next_role", "next_role(task, transcript) -> str | None", "optional"),
    Hook("max_turns", "max_turns: int", "optional"),
    Hook("score_turns", "score_turns(task, transcript, results) -> list[float] | None", "optional"),
    Hook("turn_weights", "turn_weights(task, transcript) -> list[float] | None", "optional"),
    Hook("team_reward_weight", "team_reward_weight: float", "optional"),
    Hook("pool_settings", "pool_settings: PoolSettings", "optional"),
    Hook("max_action_bytes", "max_action_bytes: int", "optional"),
    Hook("own_reply_warmup_examples", "own_reply_warmup_examples(role, rng, count, replies) -> list | None",
         "optional"),
)


def missing_hooks(env_class: type, *, builtin_model: bool = False, warmup: bool = False,
                  builtin_reward_model: bool = False, evaluation: bool = False) -> list[str]:
    """What ``env_class`` lacks for a run that uses the given features, each as ``name (why)``."""
    actions = _has(env_class, "with actions")
    needed = {"always": True, "without actions": not actions, "with actions": False, "built-in model": builtin_model,
              "warm-up": warmup, "built-in reward model": builtin_reward_model, "evaluation": evaluation,
              "optional": False}
    why = {"always": "every run", "without actions": "a plugin without actions + run_action",
           "built-in model": "an agent on builtin:tiny", "warm-up": "an agent with warmup.steps > 0",
           "built-in reward model": "reward_model.model builtin:tiny", "evaluation": "evaluation.every"}
    return [f"{hook.name} ({why[hook.need]})" for hook in HOOKS if needed[hook.need] and not hasattr(env_class,
                                                                                                   hook.name)]


@dataclass(frozen=True)
class PluginHooks:
    """A plugin's optional hooks, resolved: a callable or None, an attribute's value or its default."""

    episode_task: Callable | None
    observe: Callable | None
    score_turns: Callable | None
    turn_weights: Callable | None
    own_reply_warmup_examples: Callable | None
    team_choice: Callable | None
    """Which of a held-out task's sampled episodes gives the team's answer (stages/team.py), or None: the team is
    not evaluated as a team."""
    answering_role: str
    """The role whose answer is the team's (``answering_role``; by default the first speaker): its held-out cases
    are the team's, its headline metric scores the team's answer."""
    next_role: Callable | None
    """Who speaks next in an episode, None once it is over (a game whose moves decide whose turn it is and when it
    ends), or None: the roles speak in ``turn_order``."""
    max_turns: int
    """The most turns an episode takes: ``len(turn_order)``, or with ``next_role`` the plugin's ``max_turns`` (by
    default the same), where an episode is cut."""
    team_reward_weight: float
    pool_settings: Any
    """The plugin's ``PoolSettings`` for its action pool, or None."""
    max_action_bytes: int
    uses_actions: bool
    """Whether its turns' actions run one by one on the action pool (``actions`` + ``run_action``)."""
    evaluated: bool
    """Whether it measures its agents on held-out cases (``evaluation_cases``, ``evaluate``, ``answer_of``)."""


def _has(env: object, need: Need) -> bool:
    """Whether ``env`` (an instance or class) defines every hook of ``need`` (the pair, the evaluation trio)."""
    return all(hasattr(env, hook.name) for hook in HOOKS if hook.need == need)


_resolved: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def hooks_of(env: object) -> PluginHooks:
    """``env``'s optional hooks, resolved on first use and kept with the instance."""
    try:
        return _resolved[env]
    except (KeyError, TypeError):  # TypeError: an instance that takes no weak reference is resolved each time
        pass
    hooks = PluginHooks(
        **{name: getattr(env, name, None) for name in ("episode_task", "observe", "score_turns", "turn_weights",
                                                        "own_reply_warmup_examples",
                                                        "team_choice", "pool_settings", "next_role")},
        answering_role=str(getattr(env, "answering_role", env.turn_order[0])),
        max_turns=int(getattr(env, "max_turns", len(env.turn_order)) if hasattr(env, "next_role")
                      else len(env.turn_order)),
        team_reward_weight=float(getattr(env, "team_reward_weight", 0.0)),
        max_action_bytes=int(getattr(env, "max_action_bytes", MAX_ACTION_BYTES)),
        uses_actions=_has(env, "with actions"), evaluated=_has(env, "evaluation"))
    try:
        _resolved[env] = hooks
    except TypeError:
        pass
    return hooks
