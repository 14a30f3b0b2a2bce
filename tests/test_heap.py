"""The collector's pause around start-up and freeze around streaming (cluster/heap.py): each restores what it
found, whatever happens inside."""

from __future__ import annotations

import gc
import weakref

import pytest

from marl_pipeline.cluster.heap import collector_paused, heap_frozen


def test_the_collector_is_paused_inside_and_as_it_was_after_even_on_an_error() -> None:
    assert gc.isenabled()
    with pytest.raises(RuntimeError), collector_paused():
        assert not gc.isenabled()
        raise RuntimeError("a start-up that failed")
    assert gc.isenabled()
    gc.disable()
    try:
        with collector_paused():
            pass
        assert not gc.isenabled()  # a caller's own pause is not undone
    finally:
        gc.enable()


def test_the_heap_is_frozen_inside_and_collectable_again_after() -> None:
    class Node:
        pass

    node = Node()
    node.self = node  # a cycle: only the cyclic collector frees it
    alive = weakref.ref(node)
    before = gc.get_freeze_count()
    with heap_frozen():
        assert gc.get_freeze_count() > before
        del node
        gc.collect()
        assert alive() is not None  # out of the collector's reach
    assert gc.get_freeze_count() == before
    gc.collect()
    assert alive() is None
