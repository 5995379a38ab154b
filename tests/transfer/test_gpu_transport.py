"""KV pages between two processes on one GPU through the transfer engine's CUDA IPC transport
(``nvlink_intra``), the way prefill writes into decode's pool. Skipped without a GPU or a CUDA
build of Mooncake; run on an H200.

The child plays decode: a bf16 pool on the GPU, registered from the event-loop-less main
thread (no CUDA call made there before: the transport must bind the context itself). The
test process plays prefill through the real ``TransferQueue``: its source pages are written by
a GPU op queued behind a long matmul loop (a forward still running), and the chunk job carries
the event recorded after it, as prefill's does. What decode reads back must equal the
finished source pages, every layer and page, and the pages not written must stay untouched.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import threading
from typing import Any

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

LAYERS, PAGES, PAGE_SIZE, KV_DIM = 4, 64, 16, 576
REPLY_TIMEOUT_S = 60.0


def _decode_main(requests: mp.Queue, replies: mp.Queue) -> None:
    from dsmesh.engine.kv.pool import MLAKVPool
    from dsmesh.runtime.transfer import make_transport

    try:
        transport = make_transport("mooncake", hostname="127.0.0.1", protocol="nvlink_intra")
        pool = MLAKVPool(LAYERS, PAGES + 16, PAGE_SIZE, KV_DIM, torch.bfloat16, "cuda")
        pool.buffer.fill_(-1.0)
        torch.cuda.synchronize()
        replies.put(("ok", transport.register_pool(pool)))
    except Exception as exc:  # report to the test instead of dying silently
        replies.put(("error", repr(exc)))
        return
    try:
        while True:
            cmd = requests.get()
            if cmd == "stop":
                return
            torch.cuda.synchronize()
            replies.put(("ok", pool.buffer.float().cpu()))
    finally:
        transport.close()


def _reply(replies: mp.Queue, proc: Any) -> Any:
    try:
        status, value = replies.get(timeout=REPLY_TIMEOUT_S)
    except queue.Empty:
        raise AssertionError(f"decode process gave no reply (alive={proc.is_alive()})") from None
    assert status == "ok", value
    return value


@pytest.fixture(scope="module")
def decode_peer():
    pytest.importorskip("mooncake.engine")
    from dsmesh.runtime.transfer.protocol import cuda_build_problem, installed_mooncake_builds

    problem = cuda_build_problem(installed_mooncake_builds(), torch.version.cuda, "nvlink_intra")
    if problem is not None:
        pytest.skip(problem)
    ctx = mp.get_context("spawn")
    requests, replies = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_decode_main, args=(requests, replies))
    proc.start()
    remote = _reply(replies, proc)

    def read() -> torch.Tensor:
        requests.put("read")
        return _reply(replies, proc)

    yield remote, read
    requests.put("stop")
    proc.join(30)
    if proc.is_alive():
        proc.kill()


def _mismatches(got: torch.Tensor, want: torch.Tensor, remote_pages: list[int]) -> list[str]:
    """What differs, per (layer, remote page): stale zeros, untouched -1s, or other values."""
    out = []
    for layer in range(got.shape[0]):
        for i, page in enumerate(remote_pages):
            g, w = got[layer, page], want[layer, i]
            if not torch.equal(g, w):
                kind = "zeros" if not g.any() else "-1" if torch.all(g == -1) else "other"
                bad = int((g != w).sum())
                out.append(f"layer {layer} page {page}: {bad} values differ ({kind})")
    return out


@pytest.mark.parametrize("busy", [False, True], ids=["idle", "during-forward"])
def test_pages_written_through_the_lanes_equal_the_finished_source(decode_peer, busy) -> None:
    from dsmesh.engine.kv.pool import MLAKVPool
    from dsmesh.prefill_svc.transfer_queue import (
        ChunkJob,
        FinalJob,
        TransferCallbacks,
        TransferQueue,
    )
    from dsmesh.runtime.transfer import make_transport

    remote, read = decode_peer
    assert remote.num_pages == PAGES + 16
    pool = MLAKVPool(LAYERS, PAGES, PAGE_SIZE, KV_DIM, torch.bfloat16, "cuda")
    transport = make_transport("mooncake", hostname="127.0.0.1", protocol="nvlink_intra")
    assert transport.signature == "mooncake/nvlink_intra"
    transport.register_pool(pool)
    done = threading.Event()
    errors: list[str] = []
    finals: list[tuple[int, int]] = []
    callbacks = TransferCallbacks(
        on_chunk=lambda rid, tokens, nbytes: None,
        on_final=lambda rid, tok, nbytes, secs: (finals.append((tok, nbytes)), done.set()),
        on_error=lambda rid, cause, msg: (errors.append(msg), done.set()),
        on_release=lambda rid: None,
    )
    lanes = TransferQueue(transport, pool, callbacks)
    try:
        local = list(range(10, 40)) + [3, 7]  # a run of 30 pages and two strays
        remote_pages = list(range(50, 80)) + [0, 45]
        expected = torch.randn(LAYERS, len(local), PAGE_SIZE, KV_DIM, device="cuda")
        # A "forward" still running: the source pages are written only after a long loop
        # of matmuls on the same stream; the event is recorded behind that write.
        a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
        for _ in range(200 if busy else 0):
            a = (a @ a).clamp_(-1, 1)
        index = torch.tensor(local, device="cuda")
        zero = torch.nan_to_num(a[0, 0].float() * 0.0)  # depends on the loop, adds nothing
        pool.buffer.index_copy_(1, index, (expected + zero).to(torch.bfloat16))
        ready = torch.cuda.Event()
        ready.record()
        lanes.begin("r1")
        lanes.put(ChunkJob("r1", local, remote_pages, remote, 100, None, ready))
        lanes.put(FinalJob("r1", 7))
        assert done.wait(REPLY_TIMEOUT_S), "the transfer never finished"
        assert errors == []
        page_bytes = PAGE_SIZE * KV_DIM * 2
        assert finals == [(7, len(local) * page_bytes * LAYERS)]
        got = read()
        want = expected.to(torch.bfloat16).float().cpu()
        assert _mismatches(got, want, remote_pages) == []
        untouched = sorted(set(range(PAGES + 16)) - set(remote_pages))
        assert torch.all(got[:, untouched] == -1.0)
    finally:
        lanes.stop()
        transport.close()


def test_a_1000_token_v2_lite_handoff_moves_fast(decode_peer) -> None:
    """Figures for docs/BENCHMARKS.md (printed, not asserted): one request's KV at V2-Lite's
    layout scaled to this pool (576 bf16 values per token per layer) through write_pages."""
    import time

    from dsmesh.engine.kv.pool import MLAKVPool
    from dsmesh.runtime.transfer import make_transport

    remote, read = decode_peer
    pool = MLAKVPool(LAYERS, PAGES, PAGE_SIZE, KV_DIM, torch.bfloat16, "cuda")
    pool.buffer.normal_()
    transport = make_transport("mooncake", hostname="127.0.0.1", protocol="nvlink_intra")
    transport.register_pool(pool)
    try:
        local, remote_pages = list(range(63)), list(range(10, 73))
        for _ in range(3):
            transport.write_pages(pool, remote, local, remote_pages)
        times = []
        for _ in range(20):
            t = time.perf_counter()
            n = transport.write_pages(pool, remote, local, remote_pages)
            times.append(time.perf_counter() - t)
        times.sort()
        median = times[len(times) // 2]
        print(f"\nGPU_TRANSFER {n} bytes in {median * 1e3:.3f} ms = {n / median / 1e9:.1f} GB/s")
        got = read()
        assert torch.equal(got[:, remote_pages], pool.buffer[:, local].float().cpu())
    finally:
        transport.close()
