"""One agent's engine replicas, driver side: their actor handles, the router that picks one per request, weight
sync one replica at a time, and restarting a replica that died.

- *Weight sync without a global stall.* :meth:`EngineReplicas.load_weights` reloads the replicas one after the
  other. While one reloads (it finishes its requests in flight, holds new ones, reloads: inference/async_engine.py)
  the router sends new episodes to the others, which keep serving the old version until their turn. Every
  completion still comes from one version, the one its turn stores.
- *Broadcast* (``ray.weight_sync: broadcast``): :meth:`EngineReplicas.broadcast_weights` has every live replica
  receive the version from the trainer at once, while serving (policy/transfer.py), then serve it one at a time.
- *Failure.* A replica whose actor died (the rollout's request fails with Ray's ``RayActorError``) is marked down
  at once, so the router sends nothing more to it, and is restarted on a thread: a new actor from the store,
  brought to the newest version this set was told to serve (the weights kept by reference from the last sync,
  since the driver commits a version to the store only once the engines serve it). It takes requests again once
  it serves that version, never an older one, so a restart cannot break the staleness bound.
- *Resizing* (the inter-agent split, ``pipeline.rollout.rebalance_replicas``): a set has ``capacity`` slots, some
  retired (down in the router, no actor). :meth:`EngineReplicas.resize` retires the highest slots (their actors
  killed once nothing is outstanding on them) or starts replicas in retired slots, the way a restart does.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from functools import partial

import ray

from marl_pipeline.inference.router import Router, rolling_sync
from marl_pipeline.policy.transfer import SyncGroup

Spawn = Callable[[int, int], "ray.actor.ActorHandle"]
"""(replica index, stored policy version) -> a new engine actor starting from that version (not yet ready)."""

Send = Callable[[SyncGroup], "ray.ObjectRef | Future"]
"""group -> the trainer's side of a weight broadcast to that group, started: what to wait on."""

Listener = Callable[[int, str, "int | None", str], None]
"""(replica index, "down" | "up" | "failed", the version it serves once up, why it failed): told of a replica that
died and of its restart, from the thread that saw it (run/events.py's ``ReplicaChanged``)."""

Release = Callable[["ray.actor.ActorHandle", bool], None]
"""(actor, keep it idle for the next launch) -> None: how the set lets go of a replica. The spawner's own (the
kept-actor registry, cluster/warm_actors.py), or a plain kill for engines started without one."""


def kill(handle, keep: bool) -> None:
    ray.kill(handle)


class EngineReplicas:
    """An agent's engine actors, ``len(handles)`` of them, routed by one :class:`Router`.

    ``spawn`` restarts a dead replica (None: a dead replica stays down, as for engines a test built itself);
    ``release`` lets go of a replica that died, was retired or outlived the set (see :data:`Release`).
    ``version`` is the policy version the handles serve now; ``base_version`` a version the store always keeps
    (version 0, which retention never prunes), which a restart starts from before loading the newest weights.
    """

    def __init__(self, agent: str, handles: list, version: int | None = None, spawn: Spawn | None = None,
                 max_outstanding: int | None = None, base_version: int = 0,
                 capacity: int | None = None, release: Release = kill) -> None:
        if not handles:
            raise ValueError(f"{agent}: an engine replica set needs at least one engine handle")
        capacity = capacity or len(handles)
        if capacity < len(handles):
            raise ValueError(f"{agent}: capacity {capacity} is below the {len(handles)} replicas given")
        self.agent, self.spawn, self.release, self.base_version = agent, spawn, release, base_version
        self.router = Router(capacity, max_outstanding)
        self._handles = [*handles, *[None] * (capacity - len(handles))]
        self._retired = set(range(len(handles), capacity))  # slots without a replica (resize)
        for slot in self._retired:
            self.router.mark_down(slot)
        self._lock = threading.Lock()
        self._sync = threading.Lock()  # one weight sync at a time
        self._version = version
        self._weights = None  # reference to the newest weights synced, for a restart
        self._group: tuple[tuple, SyncGroup] | None = None  # the broadcast group's members and group
        self._sender_address: str | None = None  # where the run's trainer hosts its broadcasts (sync_from)
        self._restarts: dict[int, threading.Thread] = {}
        self._starting: dict[int, object] = {}  # replica -> its replacement actor, until it serves
        self._closed = False
        self.restarted: list[tuple[int, int]] = []
        """(replica, version it came back at), in order: what a test or the run's metadata reads."""
        self.restart_errors: list[str] = []
        self.listener: Listener | None = None

    def __len__(self) -> int:
        return len(self._handles)

    def handle(self, replica: int):
        with self._lock:
            return self._handles[replica]

    def handles(self) -> list:
        """The replicas' actors (retired slots have none)."""
        with self._lock:
            return [handle for handle in self._handles if handle is not None]

    def active(self) -> int:
        """Replicas this set holds or is starting (slots not retired)."""
        with self._lock:
            return len(self._handles) - len(self._retired)

    def primary(self):
        """A live replica's handle, for calls that any replica answers alike (evaluation, tokenizer, directory)."""
        with self._lock:
            slots = [i for i, handle in enumerate(self._handles) if handle is not None and i not in self._retired]
            live = [i for i in slots if not self.router.is_down(i)]
            return self._handles[(live or slots)[0]]

    @property
    def version(self) -> int | None:
        """The newest version this set was told to serve (every live replica serves it once a sync returns)."""
        with self._lock:
            return self._version

    # -- weight sync ------------------------------------------------------------------------------
    def load_weights(self, weights, version: int) -> int:
        """Sync ``weights`` (an object reference to named tensors) as ``version`` into every replica, one at a time,
        so that the others keep serving meanwhile; a replica down or dying now gets it from its restart."""
        with self._sync:
            with self._lock:
                self._weights, self._version = weights, version
            for replica in rolling_sync(self.router, range(len(self))):  # one down: its restart loads the version
                if (handle := self.handle(replica)) is None:
                    continue  # retired just now
                try:
                    ray.get(handle.load_weights.remote(weights, version))
                except ray.exceptions.RayActorError:
                    self.replica_died(replica, handle)
        return version

    def sync_from(self, trainer, weights, version: int, broadcast: bool) -> int:
        """The run's sync of a trainer's new version: ``weights`` is what its ``named_weights`` returned
        (:meth:`load_weights`), or with ``broadcast`` its ``stage_weights`` (:meth:`broadcast_weights`)."""
        if not broadcast:
            return self.load_weights(weights, version)
        if self._sender_address is None:
            self._sender_address = ray.get(trainer.weights_address.remote())
        return self.broadcast_weights(self._sender_address, partial(trainer.send_weights.remote, version=version),
                                      ray.get(weights), version, trainer.staged_weights.remote)

    def broadcast_weights(self, address: str, send: Send, manifest, version: int,
                          fetch: Callable[[int], ray.ObjectRef]) -> int:
        """Sync ``version`` by broadcast (policy/transfer.py): every live replica receives it from the trainer at once
        while serving, over a group hosted at ``address`` (the trainer's); ``send(group)`` starts the trainer's side
        and returns what to wait on (a Ray reference or a future). The replicas then serve it one at a time, as
        :meth:`load_weights` does. A replica restarted later loads ``fetch(version)``: a reference to the trainer's
        staged copy, asked for only then. A group whose transfer failed (a replica died in it) is remade with the
        live replicas and the transfer retried once."""
        with self._sync:
            for attempt in (1, 2):
                with self._lock:
                    live = [(slot, handle) for slot, handle in enumerate(self._handles)
                            if handle is not None and not self.router.is_down(slot)]
                if not live:
                    raise RuntimeError(f"{self.agent}: no live replica to broadcast version {version} to")
                members = tuple(handle for _, handle in live)  # equal when they are the same actors
                if self._group is None or self._group[0] != members or self._group[1].address != address:
                    self._group = (members, SyncGroup(address, f"{self.agent}-{uuid.uuid4().hex[:12]}",
                                                      len(live) + 1))
                group = self._group[1]
                receiving = [(slot, handle, handle.receive_weights.remote(group, rank, manifest, version))
                             for rank, (slot, handle) in enumerate(live, start=1)]
                sending = send(group)
                failed = []
                for slot, handle, ref in receiving:
                    try:
                        ray.get(ref)
                    except ray.exceptions.RayActorError:
                        self.replica_died(slot, handle)
                        failed.append(f"replica {slot} died")
                    except ray.exceptions.RayError as error:
                        failed.append(f"replica {slot}: {error}")
                try:
                    sending.result() if isinstance(sending, Future) else ray.get(sending)
                except Exception as error:
                    failed.append(f"trainer: {error}")
                if not failed:
                    break
                self._group = None  # remade from the live replicas
                if attempt == 2:
                    raise RuntimeError(f"{self.agent}: broadcasting version {version} failed twice: {failed}")
            with self._lock:  # a restart from now on aims at this version
                self._version, self._weights = version, partial(fetch, version)
            handles = dict(live)
            for slot in rolling_sync(self.router, handles):  # one down meanwhile: its restart loads the version
                if self.handle(slot) is not handles[slot]:
                    continue  # retired meanwhile
                try:
                    ray.get(handles[slot].load_received.remote(version))
                except ray.exceptions.RayActorError:
                    self.replica_died(slot, handles[slot])
        return version

    # -- failure ----------------------------------------------------------------------------------
    def replica_died(self, replica: int, handle) -> None:
        """``handle`` (replica ``replica``) failed with ``RayActorError``: route nothing to it, restart it. Called by
        every request that saw it fail; only the first starts the restart."""
        with self._lock:
            if self._handles[replica] is not handle or replica in self._restarts or replica in self._retired:
                return  # already replaced, being restarted, or retired on purpose
            self.router.mark_down(replica)
            if self.spawn is not None:
                thread = threading.Thread(target=self._restart, args=(replica, handle), daemon=True,
                                          name=f"restart-{self.agent}-{replica}")
                self._restarts[replica] = thread
        if self.spawn is None:
            self._tell(replica, "down", None, "not restarted: this set has no spawn")
            return
        self._tell(replica, "down", None)
        thread.start()

    def _tell(self, replica: int, state: str, version: int | None, detail: str = "") -> None:
        if self.listener is not None:
            self.listener(replica, state, version, detail)

    def restarting(self) -> bool:
        with self._lock:
            return bool(self._restarts)

    def wait_restarts(self, timeout: float | None = None) -> None:
        """Wait for the restarts under way (tests, shutdown)."""
        with self._lock:
            threads = list(self._restarts.values())
        for thread in threads:
            thread.join(timeout)

    def _restart(self, replica: int, dead) -> None:
        try:
            if dead is not None:
                # A hung actor (not a dead one) must not come back beside its replacement; released, not just
                # killed, so the kept-actor registry forgets it (cluster/warm_actors.py).
                self.release(dead, False)
        except Exception:  # already gone: the usual case
            pass
        try:
            with self._lock:
                version, weights = self._version, self._weights
            handle = self.spawn(replica, version if weights is None else self.base_version)
            with self._lock:
                self._starting[replica] = handle
                closed = self._closed
            if closed:
                self.release(handle, False)
                return
            served = ray.get(handle.policy_version.remote())
            while True:  # a sync may have set a newer version while this one loaded
                with self._lock:
                    version, weights = self._version, self._weights
                    if self._closed or replica in self._retired:  # the run ended, or the slot was retired
                        self.release(handle, False)  # it must not outlive its set
                        return
                    if served == version:
                        self._handles[replica] = handle
                        self.router.mark_up(replica)
                        self.restarted.append((replica, version))
                        break
                try:
                    served = ray.get(handle.load_weights.remote(weights() if callable(weights) else weights, version))
                except ray.exceptions.RayTaskError:
                    with self._lock:
                        if self._version == version:
                            raise
                    continue  # the trainer sent a newer version meanwhile and dropped this one: load that
            if dead is not None:  # a restart, not a resize's planned start
                self._tell(replica, "up", version)
        except Exception as error:  # the replica stays down; the others serve
            if not self._closed:  # else: killed by shutdown while it started, as it should be
                self.restart_errors.append(f"{self.agent}/{replica}: {error!r}")
                if dead is not None:
                    self._tell(replica, "failed", None, repr(error))
        finally:
            with self._lock:
                self._restarts.pop(replica, None)
                self._starting.pop(replica, None)

    # -- resizing ---------------------------------------------------------------------------------
    def resize(self, replicas: int, drain_timeout_s: float = 60.0) -> None:
        """Hold ``replicas`` replicas: retire the highest slots (no new request reaches them at once; their actors
        are killed once their outstanding requests are done, or after ``drain_timeout_s``), or start replicas in
        retired slots (they take requests once they serve the current version, as a restart does). Returns once the
        retired actors are gone."""
        if not 1 <= replicas <= len(self):
            raise ValueError(f"{self.agent}: {replicas} replicas requested; this set holds 1 to {len(self)}")
        if self.spawn is None:
            raise ValueError(f"{self.agent}: this replica set cannot start replicas (no spawn function)")
        with self._sync, self._lock:  # not while a weight sync walks the slots
            held = [i for i in range(len(self)) if i not in self._retired]
            retire = held[replicas:] if replicas < len(held) else []
            start = sorted(self._retired)[:max(0, replicas - len(held))]
            for slot in retire:
                self._retired.add(slot)
                self.router.mark_down(slot)
            for slot in start:
                self._retired.discard(slot)
                self._restarts[slot] = threading.Thread(target=self._restart, args=(slot, None), daemon=True,
                                                        name=f"start-{self.agent}-{slot}")
            threads = [self._restarts[slot] for slot in start]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + drain_timeout_s
        for slot in retire:
            while self.router.outstanding()[slot] > 0 and time.monotonic() < deadline:
                time.sleep(0.05)
            with self._lock:
                handle, self._handles[slot] = self._handles[slot], None
            if handle is not None:
                _kill_and_wait(handle, self.release)

    def shutdown(self, keep: bool = False) -> None:
        """Kill every replica, and the replacement of one still restarting (its thread then ends); with ``keep``,
        leave the replicas that are up idle for the next launch (cluster/warm_actors.py)."""
        with self._lock:
            self._closed = True
            up = [h for slot, h in enumerate(self._handles) if h is not None and not self.router.is_down(slot)]
            handles = [h for h in [*self._handles, *self._starting.values()] if h is not None]
        for handle in handles:
            try:
                self.release(handle, keep and any(handle is other for other in up))
            except Exception:  # a replica that died and was not replaced yet
                pass


def _kill_and_wait(handle, release: Release, timeout_s: float = 30.0) -> None:
    """Kill an actor and return once it is gone. ``ray.kill`` only asks the cluster to: a call made just after it
    can still reach the actor (a flaky failure seen in CI), and its CPUs are not yet free for the replica another
    agent starts in their place."""
    release(handle, False)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(handle.__ray_ready__.remote(), timeout=1.0)
        except ray.exceptions.RayActorError:
            return
        except ray.exceptions.GetTimeoutError:
            pass
        time.sleep(0.05)


def as_replicas(engines: dict) -> dict[str, EngineReplicas]:
    """``{agent: EngineReplicas}`` from a run's replica sets, or from plain engine handles (one replica each, not
    restarted: a test's or a recomputation's engines)."""
    return {agent: engine if isinstance(engine, EngineReplicas) else EngineReplicas(agent, [engine])
            for agent, engine in engines.items()}
