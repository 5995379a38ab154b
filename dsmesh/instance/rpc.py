"""gRPC at the edge of a prefill, decode or unified servicer: request fields converted, typed
failures answered as statuses.

The handlers raise :class:`~dsmesh.instance.failures.CallFailed` or
:class:`~dsmesh.engine.errors.InvalidRequestError`; :func:`unary` and :func:`server_stream` turn
them into ``context.abort`` with the status of that name, so no handler body calls it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol, TypeVar

import grpc

from dsmesh.engine.errors import InvalidRequestError
from dsmesh.engine.sampling.params import SamplingParams
from dsmesh.instance.failures import CallFailed
from dsmesh.runtime.convert import require_request_id, sampling_from_proto
from dsmesh.v1 import generation_pb2

Req = TypeVar("Req")
Resp = TypeVar("Resp")


class GenerationRequest(Protocol):
    """What PrefillRequest and DecodeRequest share."""

    request_id: str
    sampling: generation_pb2.SamplingParams
    resumed_tokens: int


def parse_request(request: GenerationRequest) -> tuple[str, SamplingParams]:
    """The request id and sampling parameters (a migrated request's ``resumed_tokens``
    among them); InvalidRequestError names a bad field."""
    require_request_id(request.request_id)
    params = sampling_from_proto(request.sampling)
    if request.resumed_tokens:
        params = dataclasses.replace(params, resumed_tokens=request.resumed_tokens)
        try:
            params.validate()
        except InvalidRequestError as exc:
            raise exc.within("sampling") from exc
    return request.request_id, params


def status_of(exc: CallFailed | InvalidRequestError) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, InvalidRequestError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    return grpc.StatusCode[exc.code.name], exc.message


def unary(
    method: Callable[[Any, Req, grpc.aio.ServicerContext], Awaitable[Resp]],
) -> Callable[[Any, Req, grpc.aio.ServicerContext], Awaitable[Resp]]:
    @functools.wraps(method)
    async def handler(self: Any, request: Req, context: grpc.aio.ServicerContext) -> Resp:
        try:
            return await method(self, request, context)
        except (CallFailed, InvalidRequestError) as exc:
            await context.abort(*status_of(exc))

    return handler


def server_stream(
    method: Callable[[Any, Req, grpc.aio.ServicerContext], AsyncIterator[Resp]],
) -> Callable[[Any, Req, grpc.aio.ServicerContext], AsyncIterator[Resp]]:
    @functools.wraps(method)
    async def handler(
        self: Any, request: Req, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[Resp]:
        try:
            # Closed with the handler, so the method's clean-up runs when gRPC drops the stream.
            async with contextlib.aclosing(method(self, request, context)) as messages:
                async for message in messages:
                    yield message
        except (CallFailed, InvalidRequestError) as exc:
            await context.abort(*status_of(exc))

    return handler
