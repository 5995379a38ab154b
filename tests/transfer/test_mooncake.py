"""MooncakeTransport between two real processes over loopback TCP.

The child process plays decode: it owns pools (float32, other num_pages than ours),
registers them with its own engine and sends back their RemotePool; the test process plays
prefill and writes pages into them, then reads the child's whole buffer back through the
queue to check every layer and page, written or not.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import queue
import random
import socket
import threading
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

pytest.importorskip("mooncake.engine")

from dsmesh.engine.kv.pool import MLAKVPool  # noqa: E402
from dsmesh.runtime.transfer import RemotePool, TransferError, make_transport  # noqa: E402
from dsmesh.runtime.transfer.mooncake import MooncakeTransport  # noqa: E402

REPLY_TIMEOUT_S = 30.0
CALL_TIMEOUT_S = 15.0


def _peer_main(requests: mp.Queue, replies: mp.Queue) -> None:
    """Child process: serve ("pool", name, layers, pages, page_size, kv_dim), ("read", name),
    ("stop",) until stopped; every request gets one reply, ("ok", value) or ("error", text)."""
    transport = MooncakeTransport()
    pools: dict[str, MLAKVPool] = {}
    replies.put(("ok", transport.session_id))
    try:
        while True:
            cmd, *args = requests.get()
            if cmd == "stop":
                return
            try:
                if cmd == "pool":
                    name, num_layers, num_pages, page_size, kv_dim = args
                    pool = MLAKVPool(num_layers, num_pages, page_size, kv_dim, torch.float32)
                    pools[name] = pool
                    replies.put(("ok", transport.register_pool(pool)))
                elif cmd == "read":
                    replies.put(("ok", pools[args[0]].buffer.numpy().copy()))
                else:
                    replies.put(("error", f"unknown command {cmd!r}"))
            except Exception as e:  # report to the test instead of dying silently
                replies.put(("error", repr(e)))
    finally:
        transport.close()


class Peer:
    def __init__(self, ctx: Any) -> None:
        self._requests: mp.Queue = ctx.Queue()
        self._replies: mp.Queue = ctx.Queue()
        self.process = ctx.Process(target=_peer_main, args=(self._requests, self._replies))
        self.process.start()
        self.session = self._reply()

    def _reply(self) -> Any:
        try:
            status, value = self._replies.get(timeout=REPLY_TIMEOUT_S)
        except queue.Empty:
            raise AssertionError(
                f"peer process gave no reply (alive={self.process.is_alive()})"
            ) from None
        assert status == "ok", value
        return value

    def call(self, *request: Any) -> Any:
        self._requests.put(request)
        return self._reply()

    def stop(self) -> None:
        if self.process.is_alive():
            self._requests.put(("stop",))
            self.process.join(5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)


@pytest.fixture(scope="module")
def peer() -> Iterator[Peer]:
    p = Peer(mp.get_context("spawn"))
    try:
        yield p
    finally:
        p.stop()


@pytest.fixture(scope="module")
def transport() -> Iterator[MooncakeTransport]:
    t = make_transport("mooncake")
    assert isinstance(t, MooncakeTransport)
    try:
        yield t
    finally:
        t.close()


def bounded(fn: Callable[..., Any], *args: Any) -> Any:
    """Run ``fn(*args)`` in a thread, as services do, failing the test if it hangs."""
    pool = ThreadPoolExecutor(1)
    try:
        return pool.submit(fn, *args).result(timeout=CALL_TIMEOUT_S)
    finally:
        pool.shutdown(wait=False)


def random_pool(num_layers: int, num_pages: int, page_size: int, kv_dim: int) -> MLAKVPool:
    pool = MLAKVPool(num_layers, num_pages, page_size, kv_dim, torch.float32)
    gen = torch.Generator().manual_seed(num_layers * 1000 + num_pages * 10 + page_size)
    pool.buffer.copy_(torch.randn(pool.buffer.shape, generator=gen))
    return pool


def expected_remote(
    local: MLAKVPool, remote: RemotePool, writes: list[tuple[list[int], list[int]]]
) -> torch.Tensor:
    """The remote buffer after ``writes`` into a zeroed pool: only written pages non-zero."""
    out = torch.zeros((remote.num_layers, remote.num_pages, local.page_size, local.kv_dim))
    for local_pages, remote_pages in writes:
        out[:, remote_pages] = local.buffer[:, local_pages]
    return out


@pytest.mark.parametrize("page_size", [1, 16])
def test_pages_land_byte_for_byte(peer: Peer, transport: MooncakeTransport, page_size: int) -> None:
    num_layers, kv_dim = 3, 24
    local = random_pool(num_layers, 29, page_size, kv_dim)
    assert transport.register_pool(local) == transport.register_pool(local)  # idempotent
    remote: RemotePool = peer.call("pool", f"ps{page_size}", num_layers, 41, page_size, kv_dim)
    assert remote.session == peer.session
    assert (remote.num_pages, remote.page_bytes) == (41, local.page_bytes)

    # Runs on both sides, runs on one side only, scattered pages, first and last pages.
    local_pages = [0, 1, 2, 3, 10, 12, 13, 14, 28, 5, 6]
    remote_pages = [7, 8, 9, 10, 40, 0, 1, 2, 20, 6, 30]
    written = bounded(transport.write_pages, local, remote, local_pages, remote_pages)
    assert written == len(local_pages) * local.page_bytes * num_layers

    got = torch.from_numpy(peer.call("read", f"ps{page_size}"))
    want = expected_remote(local, remote, [(local_pages, remote_pages)])
    assert torch.equal(got, want)
    assert got.count_nonzero() > 0


def test_more_segments_than_the_engine_queue(peer: Peer, transport: MooncakeTransport) -> None:
    # 2 layers x 1500 scattered pages = 3000 segments; Mooncake's TCP transport fails a call
    # that queues more than 2048 segments to one peer, so write_pages must split it.
    local = random_pool(2, 3000, 1, 8)
    transport.register_pool(local)
    remote: RemotePool = peer.call("pool", "many", 2, 4000, 1, 8)
    rng = random.Random(0)
    local_pages = list(range(0, 3000, 2))
    remote_pages = rng.sample(range(4000), len(local_pages))
    written = bounded(transport.write_pages, local, remote, local_pages, remote_pages)
    assert written == 1500 * 2 * local.page_bytes
    got = torch.from_numpy(peer.call("read", "many"))
    assert torch.equal(got, expected_remote(local, remote, [(local_pages, remote_pages)]))


def test_concurrent_writes_from_threads(peer: Peer, transport: MooncakeTransport) -> None:
    local = random_pool(4, 64, 4, 16)
    transport.register_pool(local)
    remote: RemotePool = peer.call("pool", "threads", 4, 100, 4, 16)
    rng = random.Random(1)
    remote_ids = rng.sample(range(100), 48)
    writes = [
        (list(range(i * 12, i * 12 + 12)), remote_ids[i * 12 : i * 12 + 12]) for i in range(4)
    ]
    barrier = threading.Barrier(len(writes))

    def write(local_pages: list[int], remote_pages: list[int]) -> int:
        barrier.wait()
        return transport.write_pages(local, remote, local_pages, remote_pages)

    with ThreadPoolExecutor(len(writes)) as pool:
        futures = [pool.submit(write, lp, rp) for lp, rp in writes]
        sizes = [f.result(timeout=CALL_TIMEOUT_S) for f in futures]
    assert sizes == [12 * local.page_bytes * 4] * 4
    got = torch.from_numpy(peer.call("read", "threads"))
    assert torch.equal(got, expected_remote(local, remote, writes))


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_failures_raise_transfer_error_and_the_engine_recovers(
    peer: Peer, transport: MooncakeTransport
) -> None:
    local = random_pool(2, 8, 4, 8)
    transport.register_pool(local)
    remote: RemotePool = peer.call("pool", "errors", 2, 8, 4, 8)

    nobody = RemotePool(f"127.0.0.1:{_closed_port()}", remote.base_ptr, 8, local.page_bytes, 2)
    with pytest.raises(TransferError, match=r"to 127\.0\.0\.1:\d+ failed \(rc=-1\)"):
        bounded(transport.write_pages, local, nobody, [0], [0])

    unregistered = RemotePool(remote.session, 1 << 20, 8, local.page_bytes, 2)
    with pytest.raises(TransferError, match=r"rc=-1"):
        bounded(transport.write_pages, local, unregistered, [0, 1], [0, 1])

    with pytest.raises(ValueError, match="KV layout mismatch"):
        transport.write_pages(random_pool(3, 8, 4, 8), remote, [0], [0])
    with pytest.raises(ValueError, match=r"remote_pages\[0\] = 8 is out of range"):
        transport.write_pages(local, remote, [0], [8])
    with pytest.raises(ValueError, match="register_pool"):
        transport.write_pages(random_pool(2, 8, 4, 8), remote, [0], [0])

    # The engine is still usable, and nothing above reached the peer's pool.
    assert bounded(transport.write_pages, local, remote, [3], [5]) == 2 * local.page_bytes
    got = torch.from_numpy(peer.call("read", "errors"))
    assert torch.equal(got, expected_remote(local, remote, [([3], [5])]))


def test_a_registered_pool_is_kept_alive(transport: MooncakeTransport) -> None:
    # Were it freed, a new tensor could reuse the registered addresses under the engine.
    pool = random_pool(1, 3, 2, 4)
    ref = weakref.ref(pool)
    transport.register_pool(pool)
    del pool
    gc.collect()
    assert ref() is not None


def test_closed_transport_refuses() -> None:
    t = MooncakeTransport()
    local = random_pool(1, 2, 1, 4)
    desc = t.register_pool(local)
    assert desc.session == t.session_id and desc.base_ptr == local.buffer.data_ptr()
    t.close()
    t.close()
    with pytest.raises(TransferError, match="closed"):
        t.write_pages(local, desc, [0], [1])
    with pytest.raises(TransferError, match="closed"):
        t.register_pool(local)
