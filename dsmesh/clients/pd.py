"""Drive one request through a (prefill, decode) pair, the client half of PD, or through a
unified instance (:func:`generate_unified`).

Decode's ``Decode`` stream and prefill's ``Prefill`` call start together; decode reserves
pages, prefill writes the KV into them and commits the first token through kv_broker, and
decode streams every token. Used by the gateway and by tests.

Tracing: both calls start in the caller's current context, so with tracing on (channels from
``dsmesh.runtime.grpc_server.channel``) their client spans are children of the caller's current span
and the services' spans join the caller's trace.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

import grpc

from dsmesh.v1 import (
    decode_pb2,
    decode_pb2_grpc,
    generation_pb2,
    kv_broker_pb2,
    kv_broker_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
)

# Decode only streams once prefill committed, so prefill's answer is due when decode ends: wait
# this long for it rather than cancel a call that succeeded (and end its span as an error).
PREFILL_SETTLE_S = 1.0


class PDError(Exception):
    """The request failed; ``code`` is the most informative status of the two sides, and
    ``side`` the role that answered it ("prefill", "decode" or "unified")."""

    def __init__(self, code: grpc.StatusCode, message: str, side: str = "") -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        self.side = side


async def generate_pd(
    prefill: prefill_pb2_grpc.PrefillStub,
    decode: decode_pb2_grpc.DecodeStub,
    request_id: str,
    input_ids: list[int],
    sampling: generation_pb2.SamplingParams,
    timeout_s: float = 120.0,
    handoff_timeout_s: float = 0.0,
    broker: kv_broker_pb2_grpc.KVBrokerStub | None = None,
    on_prefilled: Callable[[prefill_pb2.PrefillResponse], None] | None = None,
    prefill_first: bool = False,
    resumed_tokens: int = 0,
) -> AsyncIterator[decode_pb2.DecodeResponse]:
    """Yield decode's messages; raise :class:`PDError` on failure. Cancelling the iterator
    (or leaving it early) cancels both calls, which frees pages on both sides.

    ``broker``: kv_broker, told that the handoff FAILED when prefill becomes unreachable
    (e.g. it died), before decode's call is cancelled; without it the handoff ends ABORTED.
    ``on_prefilled``: called with prefill's answer when it succeeded (the request has left
    prefill's queue by then; the answer says what its KV handoff cost and how much of the
    prompt its prefix cache served), at the latest before the last message is yielded; with
    ``prefill_first``, before the first (decode's first message waits for prefill's answer,
    which then carries what the client must see first: the prompt logprobs).
    ``resumed_tokens``: a migrated request, whose ``input_ids`` end with that many tokens of
    its own output (docs/RELIABILITY.md).
    """
    decode_call = decode.Decode(
        decode_pb2.DecodeRequest(
            request_id=request_id,
            input_ids=input_ids,
            sampling=sampling,
            handoff_timeout_ms=int(handoff_timeout_s * 1000),
            resumed_tokens=resumed_tokens,
        ),
        timeout=timeout_s,
    )
    prefill_call = prefill.Prefill(
        prefill_pb2.PrefillRequest(
            request_id=request_id,
            input_ids=input_ids,
            sampling=sampling,
            resumed_tokens=resumed_tokens,
        ),
        timeout=timeout_s,
    )
    prefill_task = asyncio.ensure_future(prefill_call)

    stopping: list[asyncio.Task[None]] = []
    reported = [False]

    def prefill_done(task: asyncio.Future) -> None:
        # A failed prefill means no KV will come: stop waiting on decode at once (decode
        # then aborts the handoff and frees its pages); _explain reports prefill's error.
        # Once: the done callback, or the stream first where it needs the answer (a done
        # task's callbacks run a loop iteration later, maybe after decode's message).
        if reported[0]:
            return
        reported[0] = True
        exc = None if task.cancelled() else task.exception()
        if not task.cancelled() and exc is None and on_prefilled is not None:
            on_prefilled(task.result())
        if not isinstance(exc, grpc.aio.AioRpcError) or exc.code() in (
            grpc.StatusCode.CANCELLED,
            grpc.StatusCode.ABORTED,  # an abort reaches decode through kv_broker
        ):
            return
        if broker is not None and exc.code() == grpc.StatusCode.UNAVAILABLE:
            reason = f"prefill unreachable: {exc.details()}"
            stopping.append(asyncio.ensure_future(_fail_then_cancel(broker, request_id, reason)))
        else:
            decode_call.cancel()

    async def _fail_then_cancel(
        stub: kv_broker_pb2_grpc.KVBrokerStub, rid: str, reason: str
    ) -> None:
        # Only for UNAVAILABLE: prefill never reached, or lost, this request's handoff. Other
        # errors (ALREADY_EXISTS, FAILED_PRECONDITION) may concern a duplicate's live handoff.
        try:
            fail = kv_broker_pb2.FailRequest(
                request_id=rid, reason=reason, cause=kv_broker_pb2.CAUSE_PREFILL_UNREACHABLE
            )
            await stub.Fail(fail, timeout=1.0)
        except grpc.aio.AioRpcError:
            pass  # decode's cancellation aborts the handoff instead
        finally:
            decode_call.cancel()

    prefill_task.add_done_callback(prefill_done)
    done = [False]
    messages = decode_call.__aiter__()
    try:
        first = True
        async for message in _relay(messages, done):
            if first and prefill_first and not prefill_task.done():
                # prefill answers right after its commit; its call's deadline bounds the wait
                await asyncio.wait({prefill_task})
            if message.finish_reason and not prefill_task.done():
                # prefill committed before decode streamed: its answer is on its way
                await asyncio.wait({prefill_task}, timeout=PREFILL_SETTLE_S)
            if ((first and prefill_first) or message.finish_reason) and prefill_task.done():
                prefill_done(prefill_task)  # on_prefilled before this message, as promised
            if first and prefill_first and not _answered(prefill_task):
                raise _answer_lost(prefill_task)
            first = False
            yield message
    except (grpc.aio.AioRpcError, asyncio.CancelledError) as exc:
        if isinstance(exc, asyncio.CancelledError) and _caller_cancelled():
            raise
        raise await _explain(exc, prefill_task) from None
    finally:
        if not done[0]:
            decode_call.cancel()
            # Resume the (possibly intercepted) response iterator once, so whatever wraps
            # it - e.g. a tracing span - ends now rather than when it is garbage-collected.
            await _drain(messages, 0.5)
        try:
            if done[0] and not prefill_task.done():
                await asyncio.wait({prefill_task}, timeout=PREFILL_SETTLE_S)
        finally:
            if not prefill_task.done():
                prefill_task.cancel()
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await prefill_task  # its outcome was reported through decode's stream
            for task in stopping:
                with contextlib.suppress(Exception, asyncio.CancelledError):
                    await task


async def generate_unified(
    unified: decode_pb2_grpc.DecodeStub,
    request_id: str,
    input_ids: list[int],
    sampling: generation_pb2.SamplingParams,
    timeout_s: float = 120.0,
    resumed_tokens: int = 0,
) -> AsyncIterator[decode_pb2.DecodeResponse]:
    """Yield a unified instance's messages (it prefills and decodes; no handoff); raise
    :class:`PDError` on failure. Cancelling the iterator (or leaving it early) cancels the
    call, which frees the request's pages there. ``resumed_tokens``: as in generate_pd."""
    call = unified.Decode(
        decode_pb2.DecodeRequest(
            request_id=request_id,
            input_ids=input_ids,
            sampling=sampling,
            resumed_tokens=resumed_tokens,
        ),
        timeout=timeout_s,
    )
    done = [False]
    messages = call.__aiter__()
    try:
        async for message in _relay(messages, done):
            yield message
    except grpc.aio.AioRpcError as exc:
        raise PDError(exc.code(), f"unified: {exc.details()}", "unified") from None
    except asyncio.CancelledError:
        if _caller_cancelled():
            raise
        raise PDError(
            grpc.StatusCode.UNAVAILABLE, f"unified: {_CLOSED_UNDER_US}", "unified"
        ) from None
    finally:
        if not done[0]:
            call.cancel()
            await _drain(messages, 0.5)


def _failed(task: asyncio.Future) -> bool:
    return task.done() and not task.cancelled() and task.exception() is not None


def _answered(task: asyncio.Future) -> bool:
    return task.done() and not task.cancelled() and task.exception() is None


def _answer_lost(prefill_task: asyncio.Future) -> PDError:
    """A request that needs prefill's answer first (its prompt logprobs) lost it: prefill's
    call was cancelled or aborted (its KV had reached decode), so the request fails with
    prefill's status rather than stream without what its client asked for."""
    exc = None if prefill_task.cancelled() else prefill_task.exception()
    why = "the call was cancelled"
    if isinstance(exc, grpc.aio.AioRpcError):
        why = f"{exc.code().name}: {exc.details()}"
    return PDError(
        grpc.StatusCode.UNAVAILABLE,
        f"prefill: its answer, which carries the prompt logprobs, was lost ({why})",
        "prefill",
    )


# grpc.aio raises CancelledError in the awaiting task both when that task is cancelled and
# when a call is cancelled under it: by prefill_done (prefill failed), or by the close of its
# channel, which the gateway does when the instance leaves kv_broker's list (a dead host).
_CLOSED_UNDER_US = "the call was cancelled: the instance left the mesh (its channel was closed)"


def _caller_cancelled() -> bool:
    """Is the current task being cancelled (by whoever awaits the request), as opposed to a
    call of ours cancelled under it? Only the first must propagate as CancelledError: the
    second must end the request with a status, or its client waits for its deadline."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


async def _relay(messages: AsyncIterator, done: list[bool]) -> AsyncIterator:
    """``messages`` up to the one with a ``finish_reason``; ``done[0]`` becomes True once the
    stream ended or finished. The stream is let end (its trailers follow at once) before the
    last message is handed over, so the call completes even if the caller stops there."""
    while True:
        try:
            message = await anext(messages)
        except StopAsyncIteration:
            done[0] = True
            return
        if message.finish_reason:
            await _drain(messages, 1.0)
            done[0] = True
            yield message
            return
        yield message


async def _drain(messages: AsyncIterator, timeout_s: float) -> None:
    async def consume() -> None:
        async for _ in messages:
            pass

    with contextlib.suppress(Exception, asyncio.CancelledError):
        await asyncio.wait_for(consume(), timeout_s)


async def _explain(decode_error: BaseException, prefill_task: asyncio.Future) -> PDError:
    """Prefer prefill's error when decode only reports the failed handoff it caused, but
    decode's ALREADY_EXISTS: the request id is a duplicate, prefill's error follows from it."""
    if (
        isinstance(decode_error, grpc.aio.AioRpcError)
        and decode_error.code() == grpc.StatusCode.ALREADY_EXISTS
    ):
        return PDError(decode_error.code(), f"decode: {decode_error.details()}", "decode")
    with contextlib.suppress(Exception, asyncio.CancelledError):
        await asyncio.wait_for(asyncio.shield(prefill_task), 0.5)
    if prefill_task.done() and not prefill_task.cancelled():
        exc = prefill_task.exception()
        if isinstance(exc, grpc.aio.AioRpcError) and exc.code() not in (
            grpc.StatusCode.CANCELLED,
            grpc.StatusCode.ABORTED,
        ):
            return PDError(exc.code(), f"prefill: {exc.details()}", "prefill")
    if isinstance(decode_error, grpc.aio.AioRpcError):
        return PDError(decode_error.code(), f"decode: {decode_error.details()}", "decode")
    if _failed(prefill_task):  # prefill_done cancelled decode's call
        return PDError(
            grpc.StatusCode.UNAVAILABLE, "decode stream stopped after prefill failed", "prefill"
        )
    return PDError(grpc.StatusCode.UNAVAILABLE, f"decode: {_CLOSED_UNDER_US}", "decode")
