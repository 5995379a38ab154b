"""Per-request KV handoff control-plane latency through a real kv_broker process.

    python -m dsmesh.bench.handoff [--requests 200]

Measures, for one request at a time over loopback gRPC, the broker round trips a handoff
costs besides moving bytes: decode's Reserve, prefill's Resolve and Commit, and decode's
Await returning DONE. Add the transfer time from ``python -m dsmesh.bench.kv_transfer`` for the
whole handoff.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from dsmesh.clients.broker import BrokerLink
from dsmesh.runtime.launcher import dsmesh_command, start_service
from dsmesh.v1 import kv_broker_pb2 as kb


async def run(address: str, requests: int) -> list[float]:
    layout = kb.KVLayout(dtype="bfloat16", page_size=16, kv_dim=576, num_layers=61, model="x")
    pool = kb.RemotePool(
        transfer_session="127.0.0.1:1", base_ptr=4096, num_pages=4096, page_bytes=18432
    )
    decode = BrokerLink(address, kb.Instance(instance_id="d", role=kb.ROLE_DECODE))
    prefill = BrokerLink(address, kb.Instance(instance_id="p", role=kb.ROLE_PREFILL))
    decode.start()
    prefill.start()
    assert await decode.wait_attached(10) and await prefill.wait_attached(10)
    times = []
    for i in range(requests + 20):
        rid = f"h{i}"
        t0 = time.perf_counter()
        await decode.stub.Reserve(
            kb.ReserveRequest(
                request_id=rid,
                decode_instance_id="d",
                layout=layout,
                pool=pool,
                page_ids=list(range(125)),
                num_tokens=2000,
            )
        )
        await prefill.stub.Resolve(
            kb.ResolveRequest(request_id=rid, prefill_instance_id="p", layout=layout, wait_ms=1000)
        )
        await prefill.stub.Commit(kb.CommitRequest(request_id=rid, first_token_id=1))
        status = await decode.stub.Await(kb.AwaitRequest(request_id=rid, wait_ms=1000))
        assert status.state == kb.HANDOFF_DONE
        if i >= 20:  # warm-up
            times.append((time.perf_counter() - t0) * 1000)
    await decode.close()
    await prefill.close()
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=200)
    args = ap.parse_args()
    broker = start_service("kv-broker", dsmesh_command("kv-broker", "--port", "0"))
    try:
        times = asyncio.run(run(broker.address, args.requests))
    finally:
        broker.stop()
    times.sort()
    p90 = times[int(0.9 * (len(times) - 1))]
    print(
        f"handoff control plane (Reserve+Resolve+Commit+Await), {len(times)} requests: "
        f"median {statistics.median(times):.2f} ms, p90 {p90:.2f} ms"
    )


if __name__ == "__main__":
    main()
