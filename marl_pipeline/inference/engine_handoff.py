"""What crosses between the asynchronous engine's event loop and its engine thread (inference/async_engine.py):
requests and reloads handed to the thread, and the deliveries that settle their callers' futures on the loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from marl_pipeline.inference.engine import Completion, PromptTooLong


class RequestAborted(RuntimeError):
    """The request was aborted (``abort``, or its caller cancelled it) before it finished."""


@dataclass(frozen=True)
class Sampled:
    """One request's completion and the policy version that sampled it."""

    completion: Completion
    version: int


class Delivery:
    """Where a result goes: the awaiting call's future, settled on its event loop from the engine thread."""

    def __init__(self, future: asyncio.Future) -> None:
        self.future = future

    def __call__(self, value: object) -> None:
        self.future.get_loop().call_soon_threadsafe(settle, self.future, value)


@dataclass
class EngineRequest:
    """A request known to the engine thread: what to add, and where to deliver the result."""

    request_id: str
    prompt: object
    params: object
    deliver: Delivery
    """Called on the engine thread with a vLLM ``RequestOutput`` or an exception."""
    version: int = -1
    lora: object = None
    """vLLM's ``LoRARequest`` of the request's named adapter (inference/engine.py), else None."""
    engine_seconds: float = 0.0
    """Its share of the engine steps so far (``Completion.engine_seconds``)."""


@dataclass
class Reload:
    named_tensors: list
    version: int
    deliver: Callable[[object], None]
    held: list[EngineRequest] = field(default_factory=list)
    """Requests that arrived while the reload waited for the ones in flight."""


def settle(future: asyncio.Future, value: object) -> None:
    if not future.done():
        future.set_result(value)


def settle_all(settled: list[tuple[asyncio.Future, object]]) -> None:
    for future, value in settled:
        settle(future, value)


def completions_or_refused(results: list, serving: int,
                            refused_alone: bool) -> tuple[int, list[Completion | PromptTooLong]]:
    """A batch's results (each a :class:`Sampled` or what ended its request) as the engine's ``generate`` returns
    them: each completion, or with ``refused_alone`` the :class:`PromptTooLong` that refused its request in its place;
    any other error is raised. The version is the oldest that sampled, else the one ``serving``."""
    kept = PromptTooLong if refused_alone else ()
    if failed := next((r for r in results if isinstance(r, BaseException) and not isinstance(r, kept)), None):
        raise failed
    versions = [r.version for r in results if isinstance(r, Sampled)]
    return min(versions, default=serving), [r.completion if isinstance(r, Sampled) else r for r in results]
