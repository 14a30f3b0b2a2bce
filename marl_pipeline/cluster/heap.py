"""Python's garbage collector in the run's long-lived processes: the driver, the engines, the trainers.

The cyclic collector walks every tracked object at each full collection. Importing torch, vLLM, transformers and
Dagster makes them by the hundred thousand, so the 6-9 full collections on the way, each longer than the last,
took 0.4-1.6 s of a process's start; and once up, the driver's full collections (~350k objects, 0.2 s each) cost
it ~30 ms a micro-batch (BENCHMARKS.md, "The bound", 2026-11-26). So, as vLLM's engine core and Ray Serve's proxy do
after their start-up: the collector is paused while a process starts, and the start-up heap is frozen (out of the
collector's reach) while a launch streams.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def collector_paused() -> Iterator[None]:
    """No automatic collection inside (an explicit ``gc.collect`` still runs); the collector as it was after."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@contextmanager
def heap_frozen() -> Iterator[None]:
    """What is alive on entry, out of the collector's reach inside (``gc.freeze``); back in it after."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
