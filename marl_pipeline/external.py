"""Calls to services outside the cluster (a search API, a code runner, an LLM judge): the client a plugin gets from
``marl_pipeline.environment.service(name)``, sync and async.

Every call of a run to a named service goes through that service's one scheduler (``marl_pipeline/services``: a
Ray actor shared by every episode, stage, action-pool worker and node of the run), which grants calls within the
quota (``services.<name>``: requests a second, tokens a minute, calls in flight), cheapest expected call first. The
client asks it for a permit, makes the HTTP call (httpx) and reports how it went; a 429, a 5xx, a timeout or a lost
connection is tried again after an exponential backoff, never sooner than the ``Retry-After`` the service sent, and
a 429 holds every caller of the service back for that long, not only this one.

Ray-free: a run reaches the scheduler through the :class:`Quota` it installs in each process that runs plugin code
(:func:`connect_services`).
"""

from __future__ import annotations

import asyncio
import email.utils
import os
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import httpx

RETRIED_STATUS = frozenset({429, 500, 502, 503, 504})
"""HTTP answers tried again: the service is throttling or failing for the moment, not refusing the call."""


class ServiceSettings(Protocol):
    """What the client reads of a service (``config.ServiceConfig``)."""

    base_url: str
    retries: int
    backoff_s: float
    max_backoff_s: float
    timeout_s: float
    headers: dict[str, str]
    api_key_env: str | None


@dataclass(frozen=True)
class Permit:
    """A granted call: its id at the scheduler and how long it waited in the queue."""

    id: int
    waited_s: float


@dataclass(frozen=True)
class CallRecord:
    """One try of a call, as the client reports it to the scheduler."""

    outcome: Literal["ok", "throttled", "error", "failed"]
    """``ok``; ``throttled``: answered 429, to be tried again; ``error``: a 5xx, a timeout or a lost connection, to
    be tried again; ``failed``: given up (refused for good, or the last try's error or 429)."""
    latency_s: float
    tokens: int
    """The response's ``usage.total_tokens`` (the estimate given to the scheduler when it has none)."""
    status_code: int | None
    retry: bool
    """Whether this try repeats an earlier one."""


class Quota(Protocol):
    """A service's scheduler, as a process reaches it."""

    def acquire(self, cost: float, tokens: int) -> Permit: ...

    async def acquire_async(self, cost: float, tokens: int) -> Permit: ...

    def release(self, permit: Permit, record: CallRecord, retry_after_s: float | None) -> None: ...


class ServiceError(RuntimeError):
    """A call the service refused for good, or that failed on every try; the message says which and why."""


def retry_after_seconds(value: str | None, now: float | None = None) -> float | None:
    """Seconds a ``Retry-After`` header asks to wait: a number of seconds or an HTTP date (None: no header)."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value).timestamp()
    except (TypeError, ValueError):
        return None
    return max(0.0, when - (time.time() if now is None else now))


class ServiceClient:
    """Calls to one service under its quota: ``post``/``apost`` for any JSON endpoint, ``chat``/``achat`` for an
    OpenAI-compatible chat completion. Thread-safe; safe in any event loop."""

    def __init__(self, name: str, settings: ServiceSettings, quota: Quota) -> None:
        self.name, self.settings, self.quota = name, settings, quota
        # Kept open, as connections that wait for a handshake after their grant would reach the service late, and
        # by a varying delay that the quota's margin must cover.
        self._http: httpx.Client | None = None
        self._async_http: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def _headers(self) -> dict[str, str]:
        headers = dict(self.settings.headers)
        if self.settings.api_key_env and (key := os.environ.get(self.settings.api_key_env)):
            headers["Authorization"] = f"Bearer {key}"
        return headers

    def post(self, path: str, body: dict[str, Any], *, expected_cost: float = 1.0, tokens: int = 0) -> dict:
        """POST ``body`` to ``base_url + path`` and return the JSON answer.

        Args:
            expected_cost: the call's relative expected time: the scheduler grants cheaper calls first.
            tokens: the call's estimated tokens, for a ``tokens_per_minute`` quota (corrected by the answer's usage).

        Raises:
            ServiceError: refused (a 4xx other than 429) or failed on every try.
        """
        if self._http is None:
            self._http = httpx.Client(timeout=self.settings.timeout_s, headers=self._headers())
        url, retried, last = self.settings.base_url + path, 0, ""
        while True:
            permit = self.quota.acquire(expected_cost, tokens)
            started = time.monotonic()
            try:
                response = self._http.post(url, json=body)
            except httpx.HTTPError as error:
                response, last = None, f"{type(error).__name__}: {error}"
            delay, answer, last = self._settle(permit, response, started, tokens, retried, last)
            if answer is not None:
                return answer
            retried += 1
            time.sleep(delay)

    async def apost(self, path: str, body: dict[str, Any], *, expected_cost: float = 1.0, tokens: int = 0) -> dict:
        """:meth:`post` for asyncio code (an ``observe`` or a reward computed in an event loop)."""
        url, retried, last = self.settings.base_url + path, 0, ""
        loop = asyncio.get_running_loop()
        if (http := self._async_http.get(loop)) is None:  # connections belong to one event loop
            http = self._async_http[loop] = httpx.AsyncClient(timeout=self.settings.timeout_s, headers=self._headers())
        while True:
            permit = await self.quota.acquire_async(expected_cost, tokens)
            started = time.monotonic()
            try:
                response = await http.post(url, json=body)
            except httpx.HTTPError as error:
                response, last = None, f"{type(error).__name__}: {error}"
            delay, answer, last = self._settle(permit, response, started, tokens, retried, last)
            if answer is not None:
                return answer
            retried += 1
            await asyncio.sleep(delay)

    def _settle(self, permit: Permit, response: httpx.Response | None, started: float, tokens: int, retried: int,
                last: str) -> tuple[float, dict | None, str]:
        """Report one try; -> (seconds before the next try, the answer when it succeeded, the last error).

        Raises:
            ServiceError: when no try is left or the service refused the call for good.
        """
        latency = time.monotonic() - started
        code = response.status_code if response is not None else None
        if response is not None and response.is_success:
            try:
                answer = response.json()
            except ValueError:
                self.quota.release(permit, CallRecord("failed", latency, tokens, code, retried > 0), None)
                raise ServiceError(f"service {self.name!r} answered HTTP {code} with a body that is not JSON: "
                                   f"{response.text[:200]!r}") from None
            usage = answer.get("usage") if isinstance(answer, dict) else None
            used = int(usage.get("total_tokens", tokens)) if isinstance(usage, dict) else tokens
            self.quota.release(permit, CallRecord("ok", latency, used, code, retried > 0), None)
            return 0.0, answer, last
        wait = retry_after_seconds(response.headers.get("retry-after")) if response is not None else None
        if response is not None:
            last = f"HTTP {code}: {response.text[:200]}"
        again = (code is None or code in RETRIED_STATUS) and retried < self.settings.retries
        outcome = "failed" if not again else ("throttled" if code == 429 else "error")
        self.quota.release(permit, CallRecord(outcome, latency, tokens, code, retried > 0),
                           wait if code == 429 else None)
        if not again:
            tries = f"after {retried + 1} tries" if code is None or code in RETRIED_STATUS else "refused"
            raise ServiceError(f"service {self.name!r} {tries}: {last}")
        backoff = min(self.settings.max_backoff_s, self.settings.backoff_s * 2 ** retried)
        return max(backoff, wait or 0.0), None, last

    def chat(self, messages: list[dict[str, str]], *, model: str, expected_cost: float = 1.0, **params: Any
             ) -> dict:
        """An OpenAI-compatible ``/chat/completions`` call (``params``: ``max_tokens``, ``logprobs``, ...)."""
        return self.post("/chat/completions", {"model": model, "messages": messages, **params},
                         expected_cost=expected_cost, tokens=estimated_tokens(messages, params))

    async def achat(self, messages: list[dict[str, str]], *, model: str, expected_cost: float = 1.0,
                    **params: Any) -> dict:
        """:meth:`chat` for asyncio code."""
        return await self.apost("/chat/completions", {"model": model, "messages": messages, **params},
                                expected_cost=expected_cost, tokens=estimated_tokens(messages, params))


def estimated_tokens(messages: list[dict[str, str]], params: dict[str, Any]) -> int:
    """A chat call's tokens before it is made: about four characters a token, plus the longest reply allowed."""
    return sum(len(message.get("content", "")) for message in messages) // 4 + int(params.get("max_tokens") or 16)


_resolve: Callable[[str], ServiceClient] | None = None
_clients: dict[str, ServiceClient] = {}


def connect_services(resolve: Callable[[str], ServiceClient] | None) -> None:
    """Install how this process finds a service's client by name (a run does it in each process that runs plugin
    code); None disconnects."""
    global _resolve
    _resolve = resolve
    _clients.clear()


def service(name: str) -> ServiceClient:
    """The client of the run's service ``name`` (``services.<name>`` in the experiment).

    Raises:
        LookupError: outside a run, or for a service the run does not declare (the message says which).
    """
    if name not in _clients:
        if _resolve is None:
            raise LookupError(f"service {name!r}: no run's services are connected in this process; services are "
                              f"called from a plugin's methods while a run declaring services.{name} runs")
        _clients[name] = _resolve(name)
    return _clients[name]
