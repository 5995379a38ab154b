"""dsmesh.runtime.transfer.base.page_segments: pure coalescing of KV pages into byte segments."""

from __future__ import annotations

import sys
from importlib.machinery import ModuleSpec

import pytest
import torch

from dsmesh.engine.kv.pool import MLAKVPool
from dsmesh.runtime.transfer import (
    RemotePool,
    make_transport,
    page_runs,
    page_segments,
    pool_segments,
)

LOCAL = 1_000_000
REMOTE = 9_000_000
PB = 100  # page_bytes


def remote_pool(num_pages: int = 20, num_layers: int = 2, page_bytes: int = PB) -> RemotePool:
    return RemotePool("127.0.0.1:1", REMOTE, num_pages, page_bytes, num_layers)


def test_contiguous_run_is_one_segment_per_layer() -> None:
    # Local pool: 10 pages per layer; remote: 20 (a different layer stride).
    segs = page_segments(LOCAL, 10, remote_pool(), [2, 3, 4], [7, 8, 9])
    assert segs == [
        (LOCAL + 2 * PB, REMOTE + 7 * PB, 3 * PB),
        (LOCAL + (10 + 2) * PB, REMOTE + (20 + 7) * PB, 3 * PB),
    ]


def test_runs_break_when_either_side_jumps() -> None:
    local = [0, 1, 2, 5, 6, 8, 9]
    remote = [4, 5, 9, 10, 12, 3, 4]
    segs = page_segments(LOCAL, 10, remote_pool(num_layers=1), local, remote)
    # (0,4)(1,5) run; (2,9) local-consecutive but remote jumps; (5,10) remote-consecutive but
    # local jumps; (6,12) local-consecutive but remote jumps; (8,3)(9,4) run.
    assert segs == [
        (LOCAL + 0 * PB, REMOTE + 4 * PB, 2 * PB),
        (LOCAL + 2 * PB, REMOTE + 9 * PB, PB),
        (LOCAL + 5 * PB, REMOTE + 10 * PB, PB),
        (LOCAL + 6 * PB, REMOTE + 12 * PB, PB),
        (LOCAL + 8 * PB, REMOTE + 3 * PB, 2 * PB),
    ]


def test_scattered_pages_are_one_segment_each_and_keep_order() -> None:
    local = [9, 3, 0]
    remote = [0, 15, 1]
    segs = page_segments(LOCAL, 10, remote_pool(num_layers=3), local, remote)
    assert len(segs) == 3 * 3
    for layer in range(3):
        for i, (lp, rp) in enumerate(zip(local, remote, strict=True)):
            assert segs[layer * 3 + i] == (
                LOCAL + (layer * 10 + lp) * PB,
                REMOTE + (layer * 20 + rp) * PB,
                PB,
            )


def test_descending_pages_do_not_coalesce() -> None:
    segs = page_segments(LOCAL, 10, remote_pool(num_layers=1), [3, 2], [3, 2])
    assert [s[2] for s in segs] == [PB, PB]


def test_layer_subset_and_empty() -> None:
    rp = remote_pool(num_layers=4)
    segs = page_segments(LOCAL, 10, rp, [1], [1], layers=range(2, 4))
    assert segs == [
        (LOCAL + (2 * 10 + 1) * PB, REMOTE + (2 * 20 + 1) * PB, PB),
        (LOCAL + (3 * 10 + 1) * PB, REMOTE + (3 * 20 + 1) * PB, PB),
    ]
    assert page_segments(LOCAL, 10, rp, [], []) == []
    assert page_segments(LOCAL, 10, rp, [1], [1], layers=range(0)) == []


def test_segments_cover_exactly_the_bytes() -> None:
    local = [0, 1, 4, 5, 6, 9]
    remote = [10, 11, 12, 2, 3, 19]
    segs = page_segments(LOCAL, 10, remote_pool(num_layers=2), local, remote)
    assert sum(n for _, _, n in segs) == len(local) * PB * 2
    assert len(segs) == 4 * 2  # runs: (0,10)(1,11) | (4,12) | (5,2)(6,3) | (9,19)


@pytest.mark.parametrize(
    ("local", "remote", "layers", "match"),
    [
        ([0, 1], [0], None, "local_pages has 2 ids but remote_pages has 1"),
        ([10], [0], None, r"local_pages\[0\] = 10 is out of range \[0, 10\)"),
        ([0, -1], [0, 1], None, r"local_pages\[1\] = -1"),
        ([0], [20], None, r"remote_pages\[0\] = 20 is out of range \[0, 20\)"),
        ([0], [0], range(1, 3), "exceed the pool's 2 layers"),
    ],
)
def test_validation_errors(
    local: list[int], remote: list[int], layers: range | None, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        page_segments(LOCAL, 10, remote_pool(), local, remote, layers)


def test_pool_segments_uses_the_buffer_and_checks_the_layout() -> None:
    pool = MLAKVPool(3, 5, 4, 8, torch.float32)
    assert pool.page_bytes == 4 * 8 * 4
    rp = RemotePool("h:1", REMOTE, 7, pool.page_bytes, 3)
    segs = pool_segments(pool, rp, [0, 1], [5, 6])
    base = pool.buffer.data_ptr()
    assert segs == [
        (
            base + layer * 5 * pool.page_bytes,
            REMOTE + (layer * 7 + 5) * pool.page_bytes,
            2 * pool.page_bytes,
        )
        for layer in range(3)
    ]
    # The segment really addresses page 1 of layer 2.
    pool.buffer[2, 1].fill_(7.0)
    assert pool.buffer.view(-1)[(2 * 5 + 1) * 32] == 7.0
    with pytest.raises(ValueError, match="KV layout mismatch"):
        pool_segments(pool, RemotePool("h:1", REMOTE, 7, pool.page_bytes * 2, 3), [0], [0])
    with pytest.raises(ValueError, match="KV layout mismatch"):
        pool_segments(pool, RemotePool("h:1", REMOTE, 7, pool.page_bytes, 2), [0], [0])


def test_make_transport_rejects_unknown_kind() -> None:
    with pytest.raises(ValueError, match="unknown KV transport 'nixl'; known: mooncake"):
        make_transport("nixl")


def test_missing_engine_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mooncake.engine", None)
    with pytest.raises(ImportError, match="pip install mooncake-transfer-engine-non-cuda") as e:
        make_transport("mooncake")
    assert "apt-get" not in str(e.value)


class _NoVerbs:
    """Import finder that fails like a CUDA/RDMA wheel on a host without libibverbs."""

    def find_spec(self, name: str, path: object, target: object = None) -> ModuleSpec | None:
        if name == "mooncake.engine":
            raise ImportError("libibverbs.so.1: cannot open shared object file")
        return None


def test_missing_rdma_libraries_say_what_to_apt_get(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "mooncake.engine", raising=False)
    monkeypatch.setattr(sys, "meta_path", [_NoVerbs(), *sys.meta_path])
    with pytest.raises(ImportError, match="apt-get install libibverbs1 libnuma1"):
        make_transport("mooncake")


def test_page_runs_follow_both_sides() -> None:
    assert page_runs([4, 5, 6], [10, 11, 12]) == [(4, 10, 3)]
    assert page_runs([4, 5, 6], [10, 12, 13]) == [(4, 10, 1), (5, 12, 2)]
    assert page_runs([7, 3], [0, 1]) == [(7, 0, 1), (3, 1, 1)]
    assert page_runs([], []) == []
