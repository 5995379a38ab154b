"""Page names and the prefix cache's change log: a reader that applies the changes since its
cursor holds exactly the names of the pages cached, whatever it missed."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from dsmesh.engine.kv.pool import PageAllocator
from dsmesh.engine.kv.prefix_cache import PrefixCache
from dsmesh.engine.kv.prefix_hashes import PrefixChanges, PrefixEventLog, page_hashes


def snapshot(limit: int) -> list[int]:
    return [-1, -2, -3][:limit]


def test_changes_since_a_cursor_are_net() -> None:
    log = PrefixEventLog(capacity=4, epoch=5)
    assert log.since(0, 0, snapshot) == PrefixChanges(5, 0, True, [-1, -2, -3], [])
    assert log.since(5, 0, snapshot) == PrefixChanges(5, 0, False, [], [])
    log.stored(10)
    log.stored(11)
    log.removed(10)  # stored, then removed: only the removal counts
    assert log.since(5, 0, snapshot) == PrefixChanges(5, 3, False, [11], [10])
    assert log.since(5, 2, snapshot) == PrefixChanges(5, 3, False, [], [10])
    log.stored(10)
    assert log.since(5, 2, snapshot) == PrefixChanges(5, 4, False, [10], [])
    log.stored(12)  # the log holds changes 2..5 now: a reader at 0 missed change 1
    assert log.since(5, 0, snapshot).reset
    assert not log.since(5, 1, snapshot).reset
    assert log.since(6, 5, snapshot).reset  # another log (the instance restarted)
    assert log.since(5, 9, snapshot).reset  # a cursor from the future: another life too


def test_a_new_log_has_a_fresh_nonzero_epoch() -> None:
    epochs = {PrefixEventLog(1).epoch for _ in range(8)}
    assert len(epochs) == 8 and 0 not in epochs


def apply(copy: set[int], changes: PrefixChanges) -> set[int]:
    if changes.reset:
        return set(changes.stored)
    assert not set(changes.stored) & set(changes.removed)
    return (copy - set(changes.removed)) | set(changes.stored)


@settings(max_examples=60, deadline=None)
@given(
    page_size=st.sampled_from([1, 2]),
    capacity=st.sampled_from([3, 64]),
    ops=st.lists(
        st.tuples(
            st.sampled_from(["insert", "evict", "read"]),
            st.lists(st.integers(0, 2), min_size=1, max_size=8),
        ),
        max_size=25,
    ),
)
def test_a_reader_follows_the_cache(page_size: int, capacity: int, ops: list) -> None:
    alloc = PageAllocator(64)
    cache = PrefixCache(alloc, page_size, max_page_names=capacity)
    copy: set[int] = set()
    cursor = (0, 0)
    for op, tokens in ops:
        if op == "insert":
            matched = cache.match(tokens + [0])
            need = len(tokens) // page_size - len(matched)
            if need > alloc.num_free_pages:
                cache.release(matched)
                continue
            pages = matched + alloc.allocate(need)
            alloc.free(cache.insert(tokens, pages, len(matched)))
        elif op == "evict":
            cache.evict(len(tokens))
        else:
            changes = cache.changes_since(*cursor)
            copy, cursor = apply(copy, changes), (changes.epoch, changes.seq)
            everything = cache.cached_hashes(1 << 20)
            assert len(set(everything)) == cache.num_cached_pages
            if len(everything) <= capacity:  # else a reset's snapshot is cut short
                assert copy == set(everything)


def test_snapshot_is_shallowest_first_then_changes_follow() -> None:
    alloc = PageAllocator(16)
    cache = PrefixCache(alloc, page_size=1, max_page_names=2)
    alloc.free(cache.insert([5, 6, 7], alloc.allocate(3), 0))
    names = page_hashes([5, 6, 7], 1)
    assert cache.cached_hashes(8) == names
    changes = cache.changes_since(0, 0)  # a new reader: the whole set, cut short
    assert changes.reset and changes.stored == names[:2]
    matched = cache.match([5, 9, 0])
    alloc.free(cache.insert([5, 9], matched + alloc.allocate(1), len(matched)))
    later = cache.changes_since(changes.epoch, changes.seq)
    assert not later.reset and later.stored == page_hashes([5, 9], 1)[1:]
