"""The gateway's calls to the instances an admitted request was placed on: its stream from a
(prefill, decode) pair or a unified instance (dsmesh/clients/pd.py), and its abort there.
No admission and no output handling here: dsmesh/gateway/core.py puts them together.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from opentelemetry.context import Context

from dsmesh.clients.pd import generate_pd, generate_unified
from dsmesh.gateway.registry import InstanceRegistry
from dsmesh.gateway.request import CoreLimits, GenerationInput, Placement
from dsmesh.runtime import telemetry
from dsmesh.runtime.convert import sampling_to_proto
from dsmesh.v1 import decode_pb2, generation_pb2, prefill_pb2


def open_stream(
    inp: GenerationInput,
    placed: Placement,
    limits: CoreLimits,
    registry: InstanceRegistry,
    on_prefilled: Callable[[prefill_pb2.PrefillResponse], None],
) -> AsyncIterator[decode_pb2.DecodeResponse]:
    """The request's messages from where it was placed, under its call id there (a migrated
    request's input ends with its earlier output: ``params.resumed_tokens``). On a pair,
    ``on_prefilled`` gets prefill's answer when prefill succeeded; with prompt logprobs asked
    for, before decode's first message (the first delta carries them). Nothing is called
    until the stream is first advanced (:func:`first_in_context`)."""
    sampling: generation_pb2.SamplingParams = sampling_to_proto(inp.params)
    call_id = placed.call_id or inp.request_id
    if placed.prefill is None:
        return generate_unified(
            placed.decode.stub,  # type: ignore[arg-type]
            call_id,
            inp.prompt_ids,
            sampling,
            timeout_s=limits.request_timeout_s,
            resumed_tokens=inp.params.resumed_tokens,
        )
    return generate_pd(
        placed.prefill.stub,  # type: ignore[arg-type]
        placed.decode.stub,  # type: ignore[arg-type]
        call_id,
        inp.prompt_ids,
        sampling,
        timeout_s=limits.request_timeout_s,
        handoff_timeout_s=limits.handoff_timeout_s,
        broker=registry.broker,
        on_prefilled=on_prefilled,
        prefill_first=inp.params.prompt_logprobs is not None,
        resumed_tokens=inp.params.resumed_tokens,
    )


async def first_in_context(
    stream: AsyncIterator, ctx: Context, on_start: Callable[[], None]
) -> AsyncIterator:
    """Advance ``stream`` the first time with ``ctx`` current: generate_pd (or
    generate_unified) starts its calls then, so they (and everything downstream) join the
    request's trace. ``on_start`` runs just before: the calls begin at that moment."""
    with telemetry.attached(ctx):
        on_start()
        try:
            first = await anext(stream)
        except StopAsyncIteration:
            return
    yield first
    async for item in stream:
        yield item


async def abort_placed(placed: Placement, request_id: str) -> bool:
    """Abort a running request on its instances (both of a pair); True when one of them
    still had it."""
    req = generation_pb2.AbortRequest(request_id=placed.call_id or request_id)
    calls = [placed.decode.stub.Abort(req, timeout=5)]
    if placed.prefill is not None:
        calls.append(placed.prefill.stub.Abort(req, timeout=5))
    results = await asyncio.gather(*calls, return_exceptions=True)
    return any(getattr(r, "aborted", False) for r in results)
