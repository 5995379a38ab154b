"""The servers ``dsmesh bench`` drives: the gateway over gRPC or REST, and the offline
engine in-process (``bench/offline.py``). One interface, :class:`Backend`."""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import AsyncIterable, AsyncIterator
from typing import Any

import grpc
from google.protobuf import json_format

from dsmesh.v1 import generation_pb2 as pb
from dsmesh.v1 import generation_pb2_grpc

BACKENDS = ("grpc", "rest", "offline")


class BenchError(Exception):
    """The benchmark cannot run at all (server unreachable, warm-up failed)."""


class RequestError(Exception):
    """One request failed; the message goes into its record and the report."""


class Backend(ABC):
    """A connection to one server. ``connect`` once, then ``generate`` from many tasks at
    once, then ``close`` once."""

    @abstractmethod
    async def connect(self, timeout_s: float) -> None:
        """Return once the server answers; raise :class:`BenchError` after ``timeout_s``."""

    @abstractmethod
    def generate(
        self, request: pb.GenerateRequest, timeout_s: float
    ) -> AsyncIterator[pb.GenerateResponse]:
        """Yield the response messages in arrival order. Any failure (transport, status code,
        HTTP error, deadline) raises :class:`RequestError` with a one-line message."""

    @abstractmethod
    async def close(self) -> None: ...


class GrpcBackend(Backend):
    """Server-streaming ``Generation.Generate`` over one shared HTTP/2 channel."""

    def __init__(self, address: str) -> None:
        self._address = address
        # No proxy: a benchmark measures the server, and http_proxy would reroute localhost.
        self._channel = grpc.aio.insecure_channel(address, options=[("grpc.enable_http_proxy", 0)])
        self._stub = generation_pb2_grpc.GenerationStub(self._channel)

    async def connect(self, timeout_s: float) -> None:
        try:
            await asyncio.wait_for(self._channel.channel_ready(), timeout_s)
        except TimeoutError:
            raise BenchError(
                f"cannot reach gRPC server at {self._address} (no connection in {timeout_s:g} s)"
            ) from None

    async def generate(
        self, request: pb.GenerateRequest, timeout_s: float
    ) -> AsyncIterator[pb.GenerateResponse]:
        call = self._stub.Generate(request, timeout=timeout_s)
        try:
            async for response in call:
                yield response
        except grpc.aio.AioRpcError as exc:
            raise RequestError(f"{exc.code().name}: {exc.details()}") from exc

    async def close(self) -> None:
        await self._channel.close()


async def sse_events(lines: AsyncIterable[bytes]) -> AsyncIterator[tuple[str, str]]:
    """Parse Server-Sent Events from raw lines into ``(event, data)`` pairs.

    Data lines of one event are joined with newlines; comments (``:``) and fields other
    than ``event``/``data`` are skipped; a last event without a blank line still counts.
    """
    event, data = "message", []
    async for raw in lines:
        line = raw.decode("utf-8").rstrip("\r\n")
        if not line:
            if data:
                yield event, "\n".join(data)
            event, data = "message", []
            continue
        if line.startswith(":"):
            continue
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "data":
            data.append(value)
        elif name == "event":
            event = value
    if data:
        yield event, "\n".join(data)


def request_json(request: pb.GenerateRequest) -> str:
    """The REST body: protobuf's JSON mapping with the proto's field names."""
    return json_format.MessageToJson(request, preserving_proto_field_name=True, indent=None)


class RestBackend(Backend):
    """``POST /v1/generate`` with a JSON body (protobuf JSON mapping), answered with SSE."""

    def __init__(self, url: str) -> None:
        self._url = url.rstrip("/")
        self._session: Any = None  # aiohttp.ClientSession, made in connect (needs a loop)

    async def connect(self, timeout_s: float) -> None:
        import aiohttp

        # limit=0: no cap on connections, or aiohttp's default of 100 would bound concurrency.
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        try:
            timeout = aiohttp.ClientTimeout(total=timeout_s)
            async with self._session.get(f"{self._url}/health", timeout=timeout) as resp:
                await resp.read()  # any HTTP answer means the server is there
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise BenchError(f"cannot reach REST server at {self._url}: {exc}") from None

    async def generate(
        self, request: pb.GenerateRequest, timeout_s: float
    ) -> AsyncIterator[pb.GenerateResponse]:
        import aiohttp

        body = request_json(request)
        headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
        try:
            async with self._session.post(
                f"{self._url}/v1/generate",
                data=body,
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=timeout_s),
            ) as resp:
                if resp.status // 100 != 2:
                    text = (await resp.text()).strip()
                    raise RequestError(f"HTTP {resp.status}: {text[:500]}")
                async for event, data in sse_events(resp.content):
                    if event == "error":
                        raise RequestError(f"error event: {data[:500]}")
                    if data.strip() == "[DONE]":
                        continue
                    yield json_format.Parse(data, pb.GenerateResponse(), ignore_unknown_fields=True)
        except (aiohttp.ClientError, TimeoutError, json_format.ParseError) as exc:
            raise RequestError(f"{type(exc).__name__}: {exc}") from exc

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
