"""Tests for dsmesh.engine.kv.pool: the page allocator, slot mapping and the paged latent pool."""

from __future__ import annotations

import random

import pytest
import torch

from dsmesh.engine.kv.pool import MLAKVPool, OutOfPagesError, PageAllocator, pages_for, slots_for
from dsmesh.engine.model.forward_batch import ForwardBatch, SequenceChunk

# --------------------------------------------------------------------------------------------
# PageAllocator
# --------------------------------------------------------------------------------------------


def test_allocate_hands_out_low_pages_first() -> None:
    alloc = PageAllocator(8)
    assert (alloc.num_free_pages, alloc.num_used_pages) == (8, 0)
    assert alloc.allocate(3) == [0, 1, 2]
    assert alloc.allocate(2) == [3, 4]
    assert (alloc.num_free_pages, alloc.num_used_pages) == (3, 5)
    assert alloc.allocate(0) == []
    assert alloc.num_free_pages == 3


def test_freed_pages_are_reused() -> None:
    alloc = PageAllocator(4)
    pages = alloc.allocate(4)
    alloc.free([pages[2], pages[0]])
    assert alloc.num_free_pages == 2
    assert sorted(alloc.allocate(2)) == [0, 2]
    assert alloc.num_free_pages == 0


def test_freed_runs_come_back_ascending() -> None:
    """A request's pages, freed in any order, are handed out again as an ascending run (one
    transfer segment per layer), most recently freed first."""
    alloc = PageAllocator(16)
    first, second = alloc.allocate(4), alloc.allocate(4)
    assert (first, second) == ([0, 1, 2, 3], [4, 5, 6, 7])
    alloc.free(list(reversed(second)))
    alloc.free([first[2], first[0], first[3], first[1]])
    assert alloc.allocate(4) == [0, 1, 2, 3]
    assert alloc.allocate(5) == [4, 5, 6, 7, 8]


def _runs(pages: list[int]) -> int:
    return 1 + sum(1 for a, b in zip(pages, pages[1:], strict=False) if b != a + 1)


def test_an_allocation_takes_the_smallest_free_run_that_holds_it() -> None:
    alloc = PageAllocator(32)
    pages = alloc.allocate(32)
    alloc.free(pages[2:10] + pages[12:16] + pages[20:32])  # free runs of 8, 4 and 12
    assert alloc.allocate(4) == [12, 13, 14, 15]
    assert alloc.allocate(9) == list(range(20, 29))
    assert alloc.allocate(1) == [2]  # a single page: the lowest free one
    # no run holds 10: the longest runs first, ascending
    assert alloc.allocate(10) == [3, 4, 5, 6, 7, 8, 9, 29, 30, 31]


def test_churn_keeps_each_requests_pages_one_run() -> None:
    """Decode-like churn: requests take 63 pages, grow a page at a time, end in any order.
    Each request's 63 pages stay one run (one KV transfer segment per layer); the free list
    this replaced handed them out in runs of 1.3 pages on average here."""
    rng = random.Random(1)
    alloc = PageAllocator(4000)
    live: list[list[int]] = []
    runs = []
    for _ in range(3000):
        if alloc.can_allocate(63 + 8) and rng.random() < 0.5:
            pages = alloc.allocate(63)
            runs.append(_runs(pages))
            live.append(pages)
        for pages in live:
            if rng.random() < 1 / 16 and alloc.can_allocate(1):
                pages += alloc.allocate(1)
        if live and rng.random() < 0.5:
            alloc.free(live.pop(rng.randrange(len(live))))
    assert len(runs) > 1000 and sum(runs) / len(runs) < 1.05, sum(runs) / len(runs)


def test_can_allocate() -> None:
    alloc = PageAllocator(5)
    alloc.allocate(2)
    assert alloc.can_allocate(0)
    assert alloc.can_allocate(3)
    assert not alloc.can_allocate(4)
    assert not alloc.can_allocate(-1)


def test_out_of_pages_leaves_state_unchanged() -> None:
    alloc = PageAllocator(6)
    held = alloc.allocate(4)
    with pytest.raises(OutOfPagesError, match="need 3 KV pages but only 2 of 6"):
        alloc.allocate(3)
    assert (alloc.num_free_pages, alloc.num_used_pages) == (2, 4)
    assert alloc.allocate(2) == [4, 5]  # the same pages as before the failed call
    alloc.free(held)
    assert alloc.num_free_pages == 4


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="num_pages"):
        PageAllocator(0)
    alloc = PageAllocator(2)
    with pytest.raises(ValueError, match="negative"):
        alloc.allocate(-1)
    assert alloc.num_free_pages == 2


def test_double_free_raises() -> None:
    alloc = PageAllocator(4)
    pages = alloc.allocate(2)
    alloc.free([pages[0]])
    with pytest.raises(ValueError, match="page 0 is not allocated"):
        alloc.free([pages[0]])
    assert (alloc.num_free_pages, alloc.num_used_pages) == (3, 1)


@pytest.mark.parametrize("page", [-1, 4, 3])
def test_free_foreign_or_unallocated_page_raises(page: int) -> None:
    alloc = PageAllocator(4)
    alloc.allocate(2)
    with pytest.raises(ValueError, match=f"page {page} is not allocated"):
        alloc.free([page])
    assert alloc.num_free_pages == 2


def test_failed_free_frees_nothing() -> None:
    alloc = PageAllocator(4)
    pages = alloc.allocate(3)
    with pytest.raises(ValueError):
        alloc.free([pages[0], 3])  # 3 was never allocated
    assert alloc.num_free_pages == 1
    alloc.free(pages)
    assert alloc.num_free_pages == 4


def test_duplicate_page_in_one_free_call_raises() -> None:
    alloc = PageAllocator(4)
    pages = alloc.allocate(2)
    with pytest.raises(ValueError):
        alloc.free([pages[0], pages[0]])
    # Had it been accepted, page 0 would now be handed out twice:
    assert alloc.num_free_pages == 2


def test_no_leak_over_many_cycles() -> None:
    rng = random.Random(0)
    alloc = PageAllocator(64)
    owned: list[list[int]] = []
    for _ in range(2000):
        if owned and (rng.random() < 0.5 or not alloc.can_allocate(1)):
            alloc.free(owned.pop(rng.randrange(len(owned))))
        else:
            n = rng.randint(1, 12)
            if alloc.can_allocate(n):
                owned.append(alloc.allocate(n))
            else:
                with pytest.raises(OutOfPagesError):
                    alloc.allocate(n)
        held = [p for group in owned for p in group]
        assert len(held) == len(set(held)), "a page was handed out twice"
        assert alloc.num_used_pages == len(held)
        assert alloc.num_free_pages == 64 - len(held)
    for group in owned:
        alloc.free(group)
    assert sorted(alloc.allocate(64)) == list(range(64))


# --------------------------------------------------------------------------------------------
# slot mapping
# --------------------------------------------------------------------------------------------


def test_pages_for() -> None:
    assert [pages_for(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_slots_for_maps_positions_through_the_page_table() -> None:
    table = torch.tensor([5, 2, 7])
    assert slots_for(table, 0, 12, 4).tolist() == [20, 21, 22, 23, 8, 9, 10, 11, 28, 29, 30, 31]
    assert slots_for(table, 3, 9, 4).tolist() == [23, 8, 9, 10, 11, 28]
    assert slots_for(table, 5, 5, 4).tolist() == []
    assert slots_for(table, 0, 12, 4).dtype == torch.int64


def test_forward_batch_uses_the_slot_mapping() -> None:
    page_size = 4
    first = SequenceChunk([11, 12, 13], 5, torch.tensor([3, 0]))  # positions 5..7
    second = SequenceChunk([21, 22], 0, torch.tensor([6]))
    batch = ForwardBatch.build([first, second], page_size, "cpu")
    assert batch.input_ids.tolist() == [11, 12, 13, 21, 22]
    assert batch.positions.tolist() == [5, 6, 7, 0, 1]
    assert batch.out_slots.tolist() == [1, 2, 3, 24, 25]
    assert batch.kv_slots[0].tolist() == [12, 13, 14, 15, 0, 1, 2, 3]
    assert batch.kv_slots[1].tolist() == [24, 25]
    assert batch.last_rows.tolist() == [2, 4]
    assert (batch.num_requests, batch.num_tokens) == (2, 5)
    assert batch.prefill_ids == [0, 1]
    with pytest.raises(ValueError, match="cannot hold"):
        ForwardBatch.build([SequenceChunk([1, 2], 3, torch.tensor([0]))], page_size, "cpu")


# --------------------------------------------------------------------------------------------
# MLAKVPool
# --------------------------------------------------------------------------------------------


def test_pool_write_read_round_trip() -> None:
    pool = MLAKVPool(num_layers=2, num_pages=4, page_size=4, kv_dim=6, dtype=torch.float32)
    assert pool.buffer.shape == (2, 4, 4, 6)
    assert pool.allocator.num_pages == 4
    assert pool.page_bytes == 4 * 6 * 4
    kv = torch.arange(18, dtype=torch.float32).view(3, 6) + 1
    slots = torch.tensor([5, 0, 15])
    pool.write(1, slots, kv)
    assert torch.equal(pool.read(1, slots), kv)
    assert torch.equal(pool.read(1, torch.tensor([15, 5])), kv[[2, 0]])
    # slot 5 is page 1 offset 1; slot 15 is page 3 offset 3
    assert torch.equal(pool.buffer[1, 1, 1], kv[0])
    assert torch.equal(pool.buffer[1, 3, 3], kv[2])
    assert int((pool.buffer[0] != 0).sum()) == 0  # other layer untouched
    assert int((pool.buffer[1] != 0).any(-1).sum()) == 3  # nothing else written
    pool.write(1, torch.tensor([0]), torch.full((1, 6), -2.0))
    assert torch.equal(pool.read(1, slots)[1], torch.full((6,), -2.0))


def test_pool_stores_in_its_dtype() -> None:
    pool = MLAKVPool(1, 2, 2, 3, torch.bfloat16)
    kv = torch.tensor([[1.0 + 2**-10, 3.0, -0.5]])
    pool.write(0, torch.tensor([3]), kv)
    out = pool.read(0, torch.tensor([3]))
    assert out.dtype == torch.bfloat16
    assert out.float().tolist() == [[1.0, 3.0, -0.5]]


def test_forward_batch_lists_its_prefill_requests_once() -> None:
    """Requests of more than one new token, as every attention layer used to list them."""
    chunks = [
        SequenceChunk([1], 3, torch.tensor([0])),
        SequenceChunk([2, 3], 0, torch.tensor([1])),
        SequenceChunk([4], 0, torch.tensor([2])),
        SequenceChunk([5, 6, 7], 1, torch.tensor([3])),
    ]
    batch = ForwardBatch.build(chunks, 4, "cpu")
    want = [i for i, n in enumerate(batch.extend_lens) if n > 1]
    assert batch.prefill_ids == want == [1, 3]
    assert batch.prefill_ids is batch.prefill_ids  # computed once per batch
    assert ForwardBatch.build(chunks[:1], 4, "cpu").prefill_ids == []


def test_pool_layer_views_are_the_buffer() -> None:
    """layer_slots (what the Triton cache write gets) views the buffer: writes through it
    are what read and the transfer engines see."""
    pool = MLAKVPool(3, 2, 4, 5, torch.float32)
    for layer in range(3):
        view = pool.layer_slots(layer)
        assert view.shape == (8, 5) and view.data_ptr() == pool.buffer[layer].data_ptr()
        view[6] = float(layer + 1)
        assert torch.equal(pool.buffer[layer, 1, 2], torch.full((5,), float(layer + 1)))
        assert torch.equal(pool.read(layer, torch.tensor([6])), view[6:7])


def test_pool_buffer_is_never_reallocated() -> None:
    pool = MLAKVPool(2, 3, 2, 4, torch.float32)
    address = pool.buffer.data_ptr()
    for layer in range(2):
        kv = torch.randn(6, 4, generator=torch.Generator().manual_seed(layer))
        pool.write(layer, torch.arange(6), kv)
    assert pool.buffer.data_ptr() == address


def test_pool_rejects_bad_page_size() -> None:
    with pytest.raises(ValueError, match="page_size"):
        MLAKVPool(1, 2, 0, 4, torch.float32)
