"""gRPC dsmesh.v1.Generation: converts and delegates to dsmesh.gateway.api."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from dsmesh.gateway import api
from dsmesh.gateway.core import GatewayError, GenerationCore
from dsmesh.runtime import telemetry
from dsmesh.v1 import generation_pb2 as pb
from dsmesh.v1 import generation_pb2_grpc


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, core: GenerationCore) -> None:
        self.core = core

    async def Generate(  # noqa: N802 - gRPC method name
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        try:
            async for msg in api.generate(self.core, request, telemetry.current_context()):
                yield msg
        except GatewayError as exc:
            await context.abort(exc.code, exc.message)

    async def Abort(  # noqa: N802
        self, request: pb.AbortRequest, context: grpc.aio.ServicerContext
    ) -> pb.AbortResponse:
        try:
            return await api.abort(self.core, request)
        except GatewayError as exc:
            await context.abort(exc.code, exc.message)
            raise  # unreachable: abort raises
