"""freeze_startup_heap: live objects leave the collector's generations; later garbage, cycles
included, is still collected."""

from __future__ import annotations

import gc
import weakref

from dsmesh.runtime.heap import freeze_startup_heap


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


def test_start_up_objects_are_frozen_and_later_cycles_still_collected() -> None:
    try:
        kept = [_Node() for _ in range(1000)]
        frozen = freeze_startup_heap()
        assert frozen >= len(kept) and gc.get_freeze_count() == frozen
        # the collector's generations now hold only what was made after the freeze
        assert not any(obj is kept for obj in gc.get_objects())
        a, b = _Node(), _Node()
        a.other, b.other = b, a  # a cycle made after start-up
        gone = weakref.ref(a)
        del a, b
        assert gone() is not None  # reference counting alone cannot free a cycle
        gc.collect()
        assert gone() is None
    finally:
        gc.unfreeze()
