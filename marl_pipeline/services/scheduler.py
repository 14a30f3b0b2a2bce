"""A run's services on Ray: one scheduler actor per service (``marl-service:<name>``), reached by name from every
process of the Ray cluster that runs plugin code (the driver, action-pool workers, on any node), so the quota is the
run's, not a process's.

A launch starts them (:func:`start_services`), connects its driver (:func:`connect`), and takes each step's figures
(:func:`step_figures`); an action-pool worker connects as it starts. The actor is named, not passed around: a
plugin's code reaches it from wherever it runs without the run handing it a handle.
"""

from __future__ import annotations

import time
from dataclasses import asdict

import ray

from marl_pipeline.config import ServiceConfig
from marl_pipeline.external import CallRecord, Permit, ServiceClient, connect_services
from marl_pipeline.services.quota import QuotaScheduler

ACTOR_PREFIX = "marl-service:"


class ServiceScheduler:
    """The Ray actor (async: thousands of callers wait in its one event loop) around a :class:`QuotaScheduler`."""

    def __init__(self, settings: ServiceConfig) -> None:
        self.settings = settings
        self.quota = QuotaScheduler(settings)

    def config(self) -> ServiceConfig:
        return self.settings

    async def acquire(self, cost: float, tokens: int) -> tuple[int, float]:
        return await self.quota.acquire(cost, tokens)

    async def release(self, permit: int, record: dict, retry_after_s: float | None) -> None:
        self.quota.release(permit, CallRecord(**record), retry_after_s)

    async def take_window(self) -> dict:
        return self.quota.take_window()


class RayQuota:
    """A process's way to its service's scheduler actor (``external.Quota``). An unscheduled service
    (``scheduled: false``) is granted at once and only counted."""

    def __init__(self, handle: ray.actor.ActorHandle, scheduled: bool) -> None:
        self.handle, self.scheduled = handle, scheduled

    def acquire(self, cost: float, tokens: int) -> Permit:
        if not self.scheduled:
            return Permit(0, 0.0)
        return Permit(*ray.get(self.handle.acquire.remote(cost, tokens)))

    async def acquire_async(self, cost: float, tokens: int) -> Permit:
        if not self.scheduled:
            return Permit(0, 0.0)
        return Permit(*await self.handle.acquire.remote(cost, tokens))

    def release(self, permit: Permit, record: CallRecord, retry_after_s: float | None) -> None:
        # Fire and forget: the next call's acquire is ordered after it by the actor's mailbox.
        self.handle.release.remote(permit.id, asdict(record), retry_after_s if self.scheduled else None)


def start_services(services: dict[str, ServiceConfig], reuse: bool = False) -> dict[str, ray.actor.ActorHandle]:
    """One scheduler actor per service, ready when returned: a launch replaces one that a launch that died left
    behind; with ``reuse`` (a recomputation beside a live launch) one that runs is shared, and not returned (the
    caller stops only what it started)."""
    handles = {}
    for name, settings in services.items():
        try:
            running = ray.get_actor(ACTOR_PREFIX + name)
        except ValueError:
            running = None
        if running is not None and reuse:
            continue
        if running is not None:
            ray.kill(running)
        handles[name] = ray.remote(ServiceScheduler).options(
            name=ACTOR_PREFIX + name, num_cpus=0, max_concurrency=10_000, lifetime=None).remote(settings)
    ray.get([handle.config.remote() for handle in handles.values()])
    return handles


def stop_services(handles: dict[str, ray.actor.ActorHandle]) -> None:
    for handle in handles.values():
        ray.kill(handle)


def resolve(name: str) -> ServiceClient:
    """The client of the run's service ``name``, found by its actor's name (``external.connect_services``)."""
    try:
        handle = ray.get_actor(ACTOR_PREFIX + name)
    except ValueError:
        raise LookupError(f"service {name!r} is not one of this run's services (services.<name> in the "
                          f"experiment)") from None
    settings = ray.get(handle.config.remote())
    return ServiceClient(name, settings, RayQuota(handle, settings.scheduled))


def connect() -> None:
    """Let this process's plugin code call the run's services (``environment.service``)."""
    connect_services(resolve)


def step_figures(handles: dict[str, ray.actor.ActorHandle], timeout_s: float = 10.0) -> dict[str, dict]:
    """Each service's figures since the previous call (a step's), by name."""
    started = time.monotonic()
    refs = {name: handle.take_window.remote() for name, handle in handles.items()}
    return {name: ray.get(ref, timeout=max(0.1, timeout_s - (time.monotonic() - started)))
            for name, ref in refs.items()}
