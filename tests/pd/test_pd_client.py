"""dsmesh/clients/pd.py when a call is cancelled under the request: the gateway closes the
channel of an instance that left kv_broker's list (a dead host, say), and grpc.aio raises
CancelledError in the task awaiting the call. The request must then fail with a status, not
pass for a cancelled caller (its client would wait for its deadline); a caller that is
cancelled still gets CancelledError. Fake servers that never answer, no engine. And the order
of prefill's answer and decode's messages, with in-process calls that fix the loop's order."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from dsmesh.clients.pd import PDError, generate_pd, generate_unified
from dsmesh.runtime.grpc_server import channel, start_server
from dsmesh.v1 import decode_pb2, decode_pb2_grpc, generation_pb2, prefill_pb2, prefill_pb2_grpc


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


class _DecodeCall:
    """Decode's stream as generate_pd uses it: its messages once ``gate`` is set."""

    def __init__(self, gate: asyncio.Event, messages: list[decode_pb2.DecodeResponse]) -> None:
        self.gate, self.messages = gate, messages

    def __aiter__(self):
        return self._messages()

    async def _messages(self):
        await self.gate.wait()
        for message in self.messages:
            yield message

    def cancel(self) -> bool:
        return False


class _Stubs:
    """Prefill answers in the same loop iteration as decode's first message comes: the
    prefill task is done when the stream looks, but its done callbacks have not run yet."""

    def __init__(self, messages: list[decode_pb2.DecodeResponse]) -> None:
        self.gate = asyncio.Event()
        self.messages = messages
        self.prefill_error: BaseException | None = None

    def Decode(self, request, timeout):  # noqa: N802 - the stub's method name
        return _DecodeCall(self.gate, self.messages)

    def Prefill(self, request, timeout):  # noqa: N802
        async def answer() -> prefill_pb2.PrefillResponse:
            self.gate.set()  # decode's message is ready before this task completes
            if self.prefill_error is not None:
                raise self.prefill_error
            return prefill_pb2.PrefillResponse(request_id=request.request_id, cached_tokens=7)

        return answer()


@pytest.mark.parametrize("prefill_first", [True, False])
def test_prefills_answer_is_handed_over_before_the_message_that_needs_it(
    prefill_first: bool,
) -> None:
    """A prompt-scoring request (prefill_first) needs prefill's answer (its prompt logprobs)
    before decode's first message; every request needs it before the last. A prefill task
    done but whose callback had not run yet let the first message through without it (the
    gateway then answers 500: "the instance sent none prompt logprobs")."""
    events: list[str] = []

    async def main() -> None:
        first = decode_pb2.DecodeResponse(request_id="r3", token_ids=[5])
        last = decode_pb2.DecodeResponse(request_id="r3", token_ids=[6], finish_reason="length")
        stubs = _Stubs([first, last])
        stream = generate_pd(
            stubs,
            stubs,
            "r3",
            [1, 2],
            SAMPLING,
            30,
            on_prefilled=lambda answer: events.append(f"prefilled {answer.cached_tokens}"),
            prefill_first=prefill_first,
        )
        async for message in stream:
            events.append(f"message {message.token_ids[0]}")

    asyncio.run(main())
    expected = ["message 5", "prefilled 7", "message 6"]  # before the last, at the latest
    if prefill_first:
        expected = ["prefilled 7", "message 5", "message 6"]
    assert events == expected


def test_a_request_that_needs_prefills_answer_fails_with_prefills_status_without_it() -> None:
    """Prefill's call aborted after its KV reached decode: decode streams, but a prompt-scoring
    request has lost its prompt logprobs. It fails UNAVAILABLE naming prefill's status, not
    with the gateway's INTERNAL "the instance sent none prompt logprobs"."""

    async def main() -> PDError:
        stubs = _Stubs([decode_pb2.DecodeResponse(token_ids=[5], finish_reason="length")])
        empty = grpc.aio.Metadata()
        reason = "aborted by the client"
        stubs.prefill_error = grpc.aio.AioRpcError(grpc.StatusCode.ABORTED, empty, empty, reason)
        stream = generate_pd(stubs, stubs, "r4", [1, 2], SAMPLING, 30, prefill_first=True)
        with pytest.raises(PDError) as failed:
            async for _ in stream:
                pass
        return failed.value

    error = asyncio.run(main())
    assert error.code == grpc.StatusCode.UNAVAILABLE
    assert error.message == (
        "prefill: its answer, which carries the prompt logprobs, was lost "
        "(ABORTED: aborted by the client)"
    )
