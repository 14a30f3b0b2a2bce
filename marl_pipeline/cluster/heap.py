"""Python's garbage collector in the run's long-lived processes: the driver, the engines, the trainers.

The cyclic collector walks every tracked object at each full collection. Importing torch, vLLM, transformers and
Dagster makes them by the hundred thousand, so the full collections on the way, each longer than the last, lengthen a
process's start; and once up, the driver's full collections walk that whole start-up heap again every few
micro-batches, in whichever thread allocates (mostly Ray's, unpickling streamed results). So, as vLLM's engine core
and Ray Serve's proxy do after their start-up: the collector is paused while a process starts, and the start-up heap
is frozen (out of the collector's reach) while a launch streams.
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
