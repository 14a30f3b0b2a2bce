"""Engine and trainer actors kept alive between the launches of one driver process (``ray.keep_actors``).

Why: starting an actor is most of a short launch. An engine's process imports vLLM and builds its engine; a
trainer's imports torch and transformers. A script, notebook or sweep
that calls ``train`` again in the same process, and the test suite, pays that at every launch. With
``ray.keep_actors`` a launch that ends cleanly leaves its engines and trainers idle here, and the next launch
takes the ones started with the same settings (and as many CPUs as its plan gives them, or fewer) and restarts
them in place at its own starting versions:

- a trainer is rebuilt in its process (``PolicyTrainer.restart``: a fresh ``__init__``, so its weights, optimizer,
  seed and options are exactly a new actor's), paying only the model load;
- an engine reloads the starting weights into the model it holds (``RolloutEngine.restart``), if it serves the
  same model (its config and tokenizer files) with the same engine settings; otherwise it builds the new engine in
  its process, without a new process's imports, where it can: on a CPU, with one rank and the threads it has.
  Where it cannot, it refuses, is stopped, and a new one is started.
- a hybrid agent's process (cluster/hybrid.py) does both: a new trainer, then its engine's restart.
- a trainer on several workers (cluster/trainers.py: ``ShardedTrainer``) is kept as one, rank 0 with its placement
  group (:func:`hold_group`): rank 0 rebuilds every rank in its process, and the ranks meet in a new process group.

Idle actors keep their CPUs and memory. A launch takes what it can and stops every idle actor it did not take,
before it waits for its new ones, so they never hold resources a new actor waits for; a recomputation or an
evaluation that took every engine it needs idle (``taken_idle``) waits for nothing and leaves the idle trainers to
the next launch. A launch that failed does not keep its actors (a dead replica, an interrupted trainer:
``Workers.shutdown``). Handles belong to a Ray cluster: those of another (after ``ray.shutdown`` and a new
``ray.init``) are forgotten, since that cluster took the actors with it.

No peer keeps actors across launches: verl, OpenRLHF and AReaL start theirs once per training process and train
until it ends. Here launches are small and many (a retraining schedule, resumed runs), so the restart is the unit.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable

import ray
from ray.util.placement_group import PlacementGroup

RESTART_TIMEOUT_S = 300.0
"""An idle actor that does not answer its restart by then is stopped and replaced by a new one."""

_lock = threading.Lock()
_idle: dict[tuple, list] = {}  # key -> idle handles
_keys: dict[object, tuple] = {}  # actor id -> key, for the actors started or taken through here
_preferred: dict[object, Hashable] = {}  # actor id -> what it was last started or restarted for (``prefer``)
_cpus: dict[object, float] = {}  # actor id -> the CPUs it reserved when it was started (``held_cpus``)
_taken: set = set()  # actor ids taken idle (restarted, not started new) and not released since
_groups: dict[object, PlacementGroup] = {}  # actor id -> the placement group that goes with it (``hold_group``)


def _cluster() -> str:
    """The Ray cluster this driver is connected to (a node id is random per cluster start)."""
    context = ray.get_runtime_context()
    return f"{context.get_node_id()}/{context.get_job_id()}"


def start(actor, settings: Hashable, *args, prefer: Hashable = None, held_cpus: float = 0.0, **kwargs):
    """An actor of ``actor`` (a ``ray.remote(...).options(...)`` class) started with ``args`` and ``kwargs``: an
    idle one kept with the same ``settings`` and restarted with them, else a new one (not yet ready).
    ``settings`` must name everything a restart cannot change: the class, the Ray resources but its CPUs, the
    threads (Ray's option wrapper does not expose the options it was given, so the caller names them).
    ``held_cpus``: the CPUs ``actor`` reserves. An idle one that reserved as many or fewer is taken: it holds no
    CPU the launch's plan did not count on (a 0.4-CPU trainer serves where the plan gives 0.5; the tenth left free
    waits for nothing). Among those, one last started or restarted with the same ``prefer`` is taken first: an
    engine that serves the same agent with the same options reloads its weights, where another would rebuild its
    engine."""
    key = (_cluster(), settings)
    while True:
        with _lock:
            handles = _idle.get(key) or []
            fits = [i for i, handle in enumerate(handles) if _cpus.get(handle._actor_id, 0.0) <= held_cpus + 1e-9]
            same = [i for i in fits if _preferred.get(handles[i]._actor_id) == prefer]
            handle = handles.pop(same[-1] if same else fits[-1]) if fits else None
        if handle is None:
            break
        try:
            if ray.get(handle.restart.remote(*args, **kwargs), timeout=RESTART_TIMEOUT_S):
                _remember(handle, key, prefer)
                with _lock:
                    _taken.add(handle._actor_id)
                return handle
        except (ray.exceptions.RayError, TimeoutError):
            pass  # it died while idle, or hung: a new one below
        with _lock:
            group = _forget(handle)
        _stop(handle, group)
    handle = actor.remote(*args, **kwargs)
    _remember(handle, key, prefer)
    with _lock:
        _cpus[handle._actor_id] = held_cpus
    return handle


def hold_group(handle, group: PlacementGroup) -> None:
    """``handle`` (started through :func:`start`) runs in ``group``, which goes with it: kept idle with it, removed
    once it is stopped."""
    with _lock:
        _groups[handle._actor_id] = group


def taken_idle(handle) -> bool:
    """Whether ``handle`` is a kept actor :func:`start` took, holding its resources already; not one started new
    (here or elsewhere), which waits for resources idle actors may hold."""
    with _lock:
        return handle._actor_id in _taken


def release(handle, keep: bool) -> None:
    """A launch is done with ``handle``: keep it idle for the next launch, or stop it."""
    with _lock:
        key = _keys.pop(handle._actor_id, None)
        _taken.discard(handle._actor_id)
        if keep and key is not None:
            _idle.setdefault(key, []).append(handle)
            return
        group = _forget(handle)
    _stop(handle, group)


def stop_idle(kinds: tuple[str, ...] | None = None) -> int:
    """Stop every idle actor (those the starting launch did not take), or those of ``kinds`` (the first item of
    their ``settings``: what :func:`start` was given); returns how many there were."""
    with _lock:
        keys = [key for key in _idle if kinds is None or key[1][0] in kinds]
        handles = [(handle, _forget(handle)) for key in keys for handle in _idle.pop(key)]
    for handle, group in handles:
        try:
            _stop(handle, group)
        except Exception:  # already gone: its cluster was shut down, or it died while idle
            pass
    return len(handles)


def idle_count() -> int:
    """Idle actors kept for the next launch."""
    with _lock:
        return sum(len(handles) for handles in _idle.values())


def in_use() -> int:
    """Actors started or taken through here and not released since: a launch's own. Zero between launches; a
    handle killed without :func:`release` (a dead replica, a retired one) would stay counted, and its key kept."""
    with _lock:
        return len(_keys)


def _forget(handle) -> PlacementGroup | None:
    """Drop what is known of an actor being stopped (under ``_lock``); the placement group that goes with it."""
    _preferred.pop(handle._actor_id, None)
    _cpus.pop(handle._actor_id, None)
    return _groups.pop(handle._actor_id, None)


def _stop(handle, group: PlacementGroup | None) -> None:
    ray.kill(handle)
    if group is not None:
        ray.util.remove_placement_group(group)


def _remember(handle, key: tuple, prefer: Hashable) -> None:
    with _lock:
        _keys[handle._actor_id] = key
        _preferred[handle._actor_id] = prefer
