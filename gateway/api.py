"""dsmesh.v1.Generation in domain terms: the handlers the gRPC servicer and REST share."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from dsmesh.runtime.convert import logprobs_to_proto, sampling_from_proto
from dsmesh.v1 import generation_pb2 as pb
from engine.errors import InvalidRequestError
from gateway.core import GatewayError, GenerationCore, invalid


def prepare(core: GenerationCore, request: pb.GenerateRequest):
    try:
        params = sampling_from_proto(request.sampling)
    except InvalidRequestError as exc:
        raise invalid(exc.field, exc.reason) from exc
    return core.prepare(request.request_id, request.text, list(request.input_ids), params)


async def generate(
    core: GenerationCore, request: pb.GenerateRequest, trace_parent=None
) -> AsyncIterator[pb.GenerateResponse]:
    """GenerateResponse messages; raises GatewayError."""
    inp = prepare(core, request)
    async for delta in core.generate(inp, trace_parent):
        msg = pb.GenerateResponse(
            request_id=inp.request_id,
            token_ids=delta.token_ids,
            text=delta.text,
            finish_reason=delta.finish_reason or "",
            logprobs=[logprobs_to_proto(lp) for lp in delta.logprobs or ()],
        )
        msg.usage.prompt_tokens = delta.prompt_tokens
        msg.usage.completion_tokens = delta.completion_tokens
        msg.usage.cached_tokens = delta.cached_tokens
        yield msg


async def abort(core: GenerationCore, request: pb.AbortRequest) -> pb.AbortResponse:
    if not request.request_id:
        raise invalid("request_id", "must be a non-empty string")
    return pb.AbortResponse(aborted=await core.abort(request.request_id))


def aggregate(messages: list[pb.GenerateResponse]) -> pb.GenerateResponse:
    """One response holding every new token and all the text (REST, stream=false)."""
    if not messages:
        # pragma: no cover - generate always yields
        raise GatewayError(grpc.StatusCode.INTERNAL, "no response")
    out = pb.GenerateResponse(request_id=messages[-1].request_id)
    for m in messages:
        out.token_ids.extend(m.token_ids)
        out.logprobs.extend(m.logprobs)
    out.text = "".join(m.text for m in messages)
    out.finish_reason = messages[-1].finish_reason
    out.usage.CopyFrom(messages[-1].usage)
    return out
