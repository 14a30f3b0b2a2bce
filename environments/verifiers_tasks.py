"""verifiers' tasksets as one role of a team: a ``Taskset`` of verifiers (prime-rl's environment library, the
``environments`` extra) gives the team its tasks, the ``solver`` answers each task's prompt, and the task's own
``@vf.reward`` functions score that answer; in ``verifiers_team`` a ``checker``, the team's own role, then says
whether the answer earns the reward.

- Loading: the taskset by verifiers' own id and loader (``environment.options.taskset``: an installed package that
  exports its ``Taskset`` subclass in ``__all__``), its config from ``taskset_config`` through the taskset's own config
  class; the first ``size`` tasks (an infinite taskset is cut there). A task is its index among them.
- Scoring: verifiers' ``Task.score`` on a trace holding the task's prompt and the solver's reply, offline (no runtime,
  no harness): the trace's reward, the weighted sum of the task's rewards, is the solver's reward.
  The checker earns 1 when its verdict (its reply's first word, ``yes`` or ``no``) says whether that reward reached
  ``pass_reward``. Each agent's own reward (``team_reward_weight`` 0).
- What does not fit, refused when the config loads, naming the taskset: a task whose rewards all need a runtime (a
  sandbox or container: ``NEEDS_CONTAINER``, or a ``runtime`` argument), a task without a prompt (where the user
  opens the conversation), or a taskset that cannot be loaded. A verifiers ``Env`` that plays several turns of its
  own (a game engine, a tool loop) is verifiers' harness, not a taskset: not adapted.

Why verifiers and not OpenEnv (issue 74.2): OpenEnv 0.10's ``fastmcp`` needs ``mcp`` below 2 while vLLM 0.32 needs 2 or
later, so the two cannot share an environment; and a verifiers task is data plus reward functions, which fit one
role's turn as they are, where an OpenEnv environment is a server stepped through a client.
"""

from __future__ import annotations

import asyncio
import inspect
from functools import cached_property
from typing import Any, ClassVar, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from environments.extras import extra
from marl_pipeline.environment import ActionResult, Turn


def _verifiers():
    return extra("verifiers.v1", "verifiers tasksets")


class VerifiersOptions(BaseModel):
    """``environment.options`` of a verifiers taskset."""

    model_config = ConfigDict(extra="forbid")

    taskset: str
    """verifiers' id of the taskset: an installed package exporting its ``Taskset`` subclass in ``__all__``."""
    taskset_config: dict[str, Any] = Field(default_factory=dict)
    """The taskset's own config (its ``TasksetConfig`` fields), as ``--env.taskset.*`` gives it in verifiers."""
    size: int = Field(200, ge=1)
    """Tasks loaded: the first ``size`` of the taskset (an infinite one is cut there)."""
    pass_reward: float = 1.0
    """The reward at which an answer counts as earning it: what the checker is asked about."""
    answer_field: str | None = None
    """A field of the tasks' data holding a reference answer, for the warm-up: the solver is shown it, the checker
    it and another task's answer, each labelled by the task's own rewards. None: no warm-up (``warmup.steps: 0``)."""
    prompt_format: Literal["chat", "text"] = "chat"
    """``chat``: the task's messages, rendered with the agent's chat template; ``text``: plain strings (the built-in
    tiny model has no template)."""

    @model_validator(mode="after")
    def loadable(self) -> VerifiersOptions:
        _load(self)
        return self


def _load(options: VerifiersOptions) -> list:
    """The taskset's first ``size`` tasks, each fit to be one role's turn; else why not."""
    _verifiers()
    from verifiers.v1.utils.loaders import load_taskset, taskset_config_type

    try:
        config = taskset_config_type(options.taskset)(id=options.taskset, **options.taskset_config)
        taskset = load_taskset(config)
        tasks = list(taskset.take(options.size))
    except (ImportError, AttributeError, TypeError, ValueError) as error:
        raise ValueError(f"verifiers taskset {options.taskset!r} cannot be loaded: {error}") from None
    if not tasks:
        raise ValueError(f"verifiers taskset {options.taskset!r} gave no tasks")
    task = tasks[0]
    if getattr(task, "NEEDS_CONTAINER", False):
        raise ValueError(f"verifiers taskset {options.taskset!r}: its tasks need a container, which a team's turn "
                         f"does not run in")
    rewards = task.hooks("reward")
    offline = [fn for fn in rewards if _offline(fn)]
    if not offline and not task.config.judges:
        raise ValueError(f"verifiers taskset {options.taskset!r}: none of its rewards "
                         f"({[fn.__name__ for fn in rewards]}) can score a reply without a runtime")
    if options.answer_field and not hasattr(task.data, options.answer_field):
        raise ValueError(f"verifiers taskset {options.taskset!r}: its tasks' data has no field "
                         f"{options.answer_field!r} (answer_field)")
    if missing := [t.data.idx for t in tasks if t.data.prompt is None]:
        raise ValueError(f"verifiers taskset {options.taskset!r}: tasks {missing[:5]} have no prompt (the user opens "
                         f"the conversation there), so there is nothing for the solver to answer")
    return tasks


def _offline(fn) -> bool:
    runtime = inspect.signature(fn).parameters.get("runtime")
    return runtime is None or runtime.default is not inspect.Parameter.empty


def _verdict(text: str) -> str | None:
    words = text.strip().lower().split()
    first = words[0].strip(".,!:;") if words else ""
    return first if first in ("yes", "no") else None


class VerifiersTaskset:
    """A verifiers taskset as a team's environment: subclass it, or call :func:`verifiers_environment`."""

    name: ClassVar[str]
    turn_order: ClassVar[tuple[str, ...]]
    Options: ClassVar[type[BaseModel]] = VerifiersOptions
    team_reward_weight = 0.0

    def __init__(self, options: VerifiersOptions) -> None:
        self.options = options

    @cached_property
    def tasks(self) -> list:
        return _load(self.options)

    def __getstate__(self) -> dict:
        return {"options": self.options}  # the tasks are loaded again where they are used (a Ray worker)

    # -- the team's turns -----------------------------------------------------------------------------------------

    def sample_tasks(self, rng: np.random.Generator, count: int) -> list[dict]:
        return [{"id": f"{self.options.taskset}-{index}", "index": index}
                for index in rng.integers(0, len(self.tasks), size=count).tolist()]

    def _messages(self, task: dict) -> list[dict]:
        """The task's conversation as chat messages: its system prompt, then its prompt (a string as the user's
        message, or its messages as they are)."""
        data = self.tasks[task["index"]].data
        messages = [] if data.system_prompt is None else [{"role": "system", "content": data.system_prompt}]
        if isinstance(data.prompt, str):
            return [*messages, {"role": "user", "content": data.prompt}]
        return [*messages, *(m.model_dump(include={"role", "content"}) for m in data.prompt)]

    def render_prompt(self, role: str, task: dict, transcript: list[Turn]):
        question = self.tasks[task["index"]].data.prompt_text
        if role == "solver":
            return self._messages(task) if self.options.prompt_format == "chat" else question
        asked = (f"{question}\nAnswer: {transcript[0].text.strip()}\nDoes the answer earn its reward? Start your "
                 f"reply with yes or no.")
        return [{"role": "user", "content": asked}] if self.options.prompt_format == "chat" else asked

    def reward_of(self, task: dict, reply: str) -> float:
        """The task's own reward of ``reply``: verifiers' ``Task.score`` on a trace of the prompt and the reply."""
        vf = _verifiers()
        from verifiers.v1.state import state_cls
        from verifiers.v1.types import AssistantMessage, UserMessage

        source = self.tasks[task["index"]]
        trace = vf.Trace(
            task=vf.TraceTask(type=type(source).__name__, data=source.data, key=source.key, hash=source.hash),
            agent=vf.AgentInfo(config=vf.AgentConfig(), name="solver"), state=state_cls(type(source))(),
            nodes=[vf.MessageNode(message=UserMessage(content=source.data.prompt_text)),
                   vf.MessageNode(parent=0, message=AssistantMessage(content=reply), sampled=True)],
            is_completed=True, ok=True)
        asyncio.run(source.score(trace))
        return trace.reward

    def execute(self, task: dict, transcript: list[Turn]) -> list[ActionResult]:
        reward = self.reward_of(task, transcript[0].text)
        earned = reward >= self.options.pass_reward
        results = [ActionResult("earned" if earned else "short", earned, info={"reward": reward})]
        if len(transcript) > 1:
            verdict = _verdict(transcript[1].text)
            right = verdict == ("yes" if earned else "no")
            results.append(ActionResult("unreadable" if verdict is None else "agreed" if right else "disagreed",
                                        right, info={"verdict": verdict}))
        return results

    def score(self, task: dict, transcript: list[Turn], results: list[ActionResult]) -> dict[str, float]:
        rewards = {"solver": results[0].info["reward"]}
        if len(results) > 1:
            rewards["checker"] = float(results[1].success)
        return rewards

    def text_corpus(self, rng: np.random.Generator, count: int) -> list[str]:
        tasks = self.sample_tasks(rng, count)
        answers = [self._answer(t) for t in tasks] if self.options.answer_field else []
        return [self.tasks[t["index"]].data.prompt_text for t in tasks] + answers + [
            "Answer: Does the answer earn its reward? Start your reply with yes or no."] * 4

    def _answer(self, task: dict) -> str:
        return str(getattr(self.tasks[task["index"]].data, self.options.answer_field))

    def warmup_examples(self, role: str, rng: np.random.Generator, count: int) -> list[tuple[str, str]]:
        """The solver: each task's reference answer; the checker: half the time a task's own answer and half another
        task's, its label what the task's rewards make of it."""
        if not self.options.answer_field:
            raise ValueError(f"a warm-up of {role} on verifiers taskset {self.options.taskset!r} needs "
                             f"environment.options.answer_field (a reference answer in its data), or warmup.steps: 0")
        tasks, others = self.sample_tasks(rng, count), self.sample_tasks(rng, count)
        if role == "solver":
            return [(self.render_prompt("solver", t, []), self._answer(t)) for t in tasks]
        examples = []
        for k, (task, other) in enumerate(zip(tasks, others)):
            answer = self._answer(task if k % 2 else other)
            earned = self.reward_of(task, answer) >= self.options.pass_reward
            examples.append((self.render_prompt("checker", task, [Turn("solver", answer)]), "yes" if earned else "no"))
        return examples


def verifiers_environment(name: str, roles: tuple[str, ...] = ("solver", "checker")) -> type[VerifiersTaskset]:
    """The environment ``name`` of a verifiers taskset: the solver alone (``("solver",)``), or the solver and a
    checker; register it with ``register_environment``."""
    if roles not in (("solver",), ("solver", "checker")):
        raise ValueError(f"roles {roles}: a verifiers taskset is the solver's, alone or with a checker")
    return type(f"Verifiers_{name}", (VerifiersTaskset,), {"name": name, "turn_order": roles})


VerifiersTask = verifiers_environment("verifiers_task", ("solver",))
VerifiersTeam = verifiers_environment("verifiers_team")
