"""KV transfer between two processes: raw Mooncake vs our write_pages.

    python -m dsmesh.bench.kv_transfer [--pages 128] [--page-size 16] [--layers 61] [--kv-dim 576]
                                [--dtype bfloat16] [--tokens 2000] [--requests 10] [--repeats 5]
                                [--device cpu|cuda] [--protocol tcp|nvlink_intra|rdma]

Host pools over loopback TCP by default; ``--device cuda --protocol nvlink_intra`` moves GPU
pools of two processes on this host through CUDA IPC (both on GPU 0 unless
``--peer-device``), with a plain device copy of the same bytes in one process as the ceiling.

A child process plays decode: it owns a pool with more pages than ours (another layer stride),
registers it with its transfer engine and waits. This process plays prefill and measures
(a) the raw engine: one contiguous ``transfer_sync_write`` of ``pages * layers * page_bytes``
bytes; (b) ``MooncakeTransport.write_pages`` of the same bytes laid out as real pages,
contiguous page ids (one segment per layer) and scattered ones (one segment per page per
layer); (c) the handoff of ``--requests`` prompts of ``--tokens`` tokens each, with
contiguous and with scattered pages on both sides, as median / p90 ms per request.
Defaults are a DeepSeek-V3 layout (61 layers, 512 + 64 latent, bf16: 70 KiB per token).
The table goes to stdout; Mooncake logs to stderr (``2>/dev/null`` to hide it).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch

from dsmesh.engine.kv.pool import MLAKVPool, pages_for
from dsmesh.runtime.transfer import RemotePool
from dsmesh.runtime.transfer.mooncake import MooncakeTransport

REPLY_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Layout:
    num_layers: int
    page_size: int
    kv_dim: int
    dtype: torch.dtype


def _decode_side(
    layout: Layout,
    num_pages: int,
    device: str,
    protocol: str,
    requests: mp.Queue,
    replies: mp.Queue,
) -> None:
    """Child: own and register a zeroed pool, answer checksums of pages, stop on request."""
    transport = MooncakeTransport(protocol=protocol)
    pool = MLAKVPool(
        layout.num_layers, num_pages, layout.page_size, layout.kv_dim, layout.dtype, device
    )
    replies.put(transport.register_pool(pool))
    try:
        while True:
            cmd, *args = requests.get()
            if cmd == "stop":
                return
            pages = args[0]
            replies.put(float(pool.buffer[:, pages].double().sum()))
    finally:
        transport.close()


def _median_p90(xs: list[float]) -> tuple[float, float]:
    ordered = sorted(xs)
    return statistics.median(ordered), ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]


def _time(fn: Any, repeats: int) -> list[float]:
    fn()  # warm-up: the first call to a peer also opens the transfer-engine session
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def _device_copy(pool: MLAKVPool, pages: int):
    """The ceiling: ``pages`` pages of every layer copied on the device within one process
    (synchronised)."""
    src, dst = pool.buffer[:, :pages], pool.buffer[:, pages : 2 * pages]

    def copy() -> None:
        dst.copy_(src)
        torch.cuda.synchronize()

    return copy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pages", type=int, default=128, help="pages per throughput transfer")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--layers", type=int, default=61)
    ap.add_argument("--kv-dim", type=int, default=576)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--tokens", type=int, default=2000, help="prompt tokens per request")
    ap.add_argument("--requests", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cpu", help="where both pools live (cpu, cuda)")
    ap.add_argument("--peer-device", default=None, help="decode's pool (default: --device)")
    ap.add_argument("--protocol", default="tcp", choices=["tcp", "nvlink_intra", "rdma"])
    args = ap.parse_args()

    layout = Layout(args.layers, args.page_size, args.kv_dim, getattr(torch, args.dtype))
    req_pages = pages_for(args.tokens, args.page_size)
    local_pages_total = 2 * max(args.pages, req_pages)
    remote_pages_total = local_pages_total + 37  # a different layer stride on purpose

    local = MLAKVPool(
        layout.num_layers,
        local_pages_total,
        layout.page_size,
        layout.kv_dim,
        layout.dtype,
        args.device,
    )
    local.buffer.normal_(generator=torch.Generator(args.device).manual_seed(0))
    peer_device = args.peer_device or args.device
    bytes_per_token = layout.num_layers * local.page_bytes // layout.page_size

    ctx = mp.get_context("spawn")
    requests: mp.Queue = ctx.Queue()
    replies: mp.Queue = ctx.Queue()
    child = ctx.Process(
        target=_decode_side,
        args=(layout, remote_pages_total, peer_device, args.protocol, requests, replies),
        daemon=True,
    )
    child.start()
    transport = MooncakeTransport(protocol=args.protocol)
    try:
        remote: RemotePool = replies.get(timeout=REPLY_TIMEOUT_S)
        transport.register_pool(local)
        rng = random.Random(0)

        def write(local_pages: list[int], remote_pages: list[int]) -> None:
            transport.write_pages(local, remote, local_pages, remote_pages)

        # A correctness spot check before timing anything.
        lp = rng.sample(range(local_pages_total), args.pages)
        rp = rng.sample(range(remote_pages_total), args.pages)
        write(lp, rp)
        requests.put(("sum", rp))
        assert replies.get(timeout=REPLY_TIMEOUT_S) == float(local.buffer[:, lp].double().sum()), (
            "remote pages differ from the local ones"
        )

        total = args.pages * layout.num_layers * local.page_bytes
        engine = transport.engine
        base = local.buffer.data_ptr()

        def raw() -> None:
            rc = engine.transfer_sync_write(remote.session, base, remote.base_ptr, total)
            assert rc == 0, f"transfer_sync_write failed (rc={rc})"

        contiguous = list(range(args.pages))
        rows = [
            ("raw transfer_sync_write", 1, _time(raw, args.repeats)),
            (
                "write_pages contiguous",
                layout.num_layers,
                _time(lambda: write(contiguous, contiguous), args.repeats),
            ),
            (
                "write_pages scattered",
                args.pages * layout.num_layers,
                _time(lambda: write(lp, rp), args.repeats),
            ),
        ]

        if local.buffer.is_cuda:
            copy = _device_copy(local, args.pages)
            rows.append(("device copy (1 process)", 1, _time(copy, args.repeats)))
        print(
            f"layout: {layout.num_layers} layers x {layout.kv_dim} {args.dtype}, page_size "
            f"{layout.page_size} ({local.page_bytes / 1024:.1f} KiB/page/layer, "
            f"{bytes_per_token / 1024:.1f} KiB/token); {args.protocol}, pools on "
            f"{args.device} -> {peer_device}, 2 processes, {os.cpu_count()} CPUs"
        )
        print(f"\nthroughput: {args.pages} pages = {total / 2**20:.1f} MiB per transfer")
        print(f"{'case':<26}{'segments':>9}{'median ms':>11}{'GB/s':>8}")
        for name, segments, times in rows:
            med = statistics.median(times)
            print(f"{name:<26}{segments:>9}{med * 1e3:>11.1f}{total / med / 1e9:>8.2f}")

        req_bytes = req_pages * layout.num_layers * local.page_bytes
        print(
            f"\nhandoff: {args.requests} requests x {args.tokens} tokens = {req_pages} pages "
            f"= {req_bytes / 2**20:.1f} MiB each"
        )
        print(f"{'pages':<26}{'segments':>9}{'median ms':>11}{'p90 ms':>8}{'GB/s':>8}")
        for name in ("contiguous", "scattered"):
            times = []
            for i in range(args.requests + 1):  # the first one is a warm-up
                if name == "contiguous":
                    start = rng.randrange(local_pages_total - req_pages + 1)
                    lp = list(range(start, start + req_pages))
                    start = rng.randrange(remote_pages_total - req_pages + 1)
                    rp = list(range(start, start + req_pages))
                else:
                    lp = rng.sample(range(local_pages_total), req_pages)
                    rp = rng.sample(range(remote_pages_total), req_pages)
                t = time.perf_counter()
                write(lp, rp)
                if i:
                    times.append(time.perf_counter() - t)
            med, p90 = _median_p90(times)
            segments = (1 if name == "contiguous" else req_pages) * layout.num_layers
            print(
                f"{name:<26}{segments:>9}{med * 1e3:>11.1f}{p90 * 1e3:>8.1f}"
                f"{req_bytes / med / 1e9:>8.2f}"
            )
    finally:
        transport.close()
        if child.is_alive():
            requests.put(("stop",))
            child.join(10)
        if child.is_alive():
            child.kill()
            child.join()


if __name__ == "__main__":
    main()
