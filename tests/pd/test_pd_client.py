"""dsmesh/clients/pd.py when a call is cancelled under the request: the gateway closes the
channel of an instance that left kv_broker's list (a dead host, say), and grpc.aio raises
CancelledError in the task awaiting the call. The request must then fail with a status, not
pass for a cancelled caller (its client would wait for its deadline); a caller that is
cancelled still gets CancelledError. Fake servers that never answer, no engine."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from dsmesh.clients.pd import PDError, generate_pd, generate_unified
from dsmesh.runtime.grpc_server import channel, start_server
from dsmesh.v1 import decode_pb2, decode_pb2_grpc, generation_pb2, prefill_pb2_grpc


class SilentDecode(decode_pb2_grpc.DecodeServicer):
    async def Decode(self, request, context):
        await asyncio.sleep(60)
        yield decode_pb2.DecodeResponse()


class SilentPrefill(prefill_pb2_grpc.PrefillServicer):
    async def Prefill(self, request, context):
        await asyncio.sleep(60)


async def _consume(stream) -> None:
    async for _ in stream:
        pass


async def _servers():
    decode = await start_server(
        lambda s: decode_pb2_grpc.add_DecodeServicer_to_server(SilentDecode(), s),
        ["dsmesh.v1.Decode"],
    )
    prefill = await start_server(
        lambda s: prefill_pb2_grpc.add_PrefillServicer_to_server(SilentPrefill(), s),
        ["dsmesh.v1.Prefill"],
    )
    return decode, prefill


SAMPLING = generation_pb2.SamplingParams(max_new_tokens=2)


@pytest.mark.parametrize("mode", ["pd", "unified"])
def test_a_channel_closed_under_the_request_fails_it_unavailable(mode: str) -> None:
    async def main() -> tuple[PDError, float]:
        decode, prefill = await _servers()
        decode_ch = channel(f"127.0.0.1:{decode.port}")
        prefill_ch = channel(f"127.0.0.1:{prefill.port}")
        try:
            decode_stub = decode_pb2_grpc.DecodeStub(decode_ch)
            if mode == "pd":
                prefill_stub = prefill_pb2_grpc.PrefillStub(prefill_ch)
                stream = generate_pd(prefill_stub, decode_stub, "r1", [1, 2], SAMPLING, 30)
            else:
                stream = generate_unified(decode_stub, "r1", [1, 2], SAMPLING, 30)
            task = asyncio.ensure_future(_consume(stream))
            await asyncio.sleep(0.3)
            closed = time.monotonic()
            await decode_ch.close()  # what the gateway's registry does when decode leaves
            with pytest.raises(PDError) as failed:
                await asyncio.wait_for(task, 5)
            return failed.value, time.monotonic() - closed
        finally:
            await prefill_ch.close()
            await decode.server.stop(0)
            await prefill.server.stop(0)

    error, seconds = asyncio.run(main())
    assert error.code == grpc.StatusCode.UNAVAILABLE
    assert "left the mesh" in error.message
    assert seconds < 2


def test_a_cancelled_caller_still_gets_cancelled_error() -> None:
    async def main() -> None:
        decode, prefill = await _servers()
        decode_ch = channel(f"127.0.0.1:{decode.port}")
        prefill_ch = channel(f"127.0.0.1:{prefill.port}")
        try:
            stream = generate_pd(
                prefill_pb2_grpc.PrefillStub(prefill_ch),
                decode_pb2_grpc.DecodeStub(decode_ch),
                "r2",
                [1, 2],
                SAMPLING,
                30,
            )
            task = asyncio.ensure_future(_consume(stream))
            await asyncio.sleep(0.3)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await asyncio.wait_for(task, 5)
        finally:
            await decode_ch.close()
            await prefill_ch.close()
            await decode.server.stop(0)
            await prefill.server.stop(0)

    asyncio.run(main())
