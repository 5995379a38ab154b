"""The servers ``dsmesh bench`` drives: the gateway over gRPC, REST or its OpenAI route, and
the offline engine in-process (``dsmesh/bench/offline.py``). One interface, :class:`Backend`."""

from __future__ import annotations

import asyncio
import json
from abc import ABC, abstractmethod
from collections.abc import AsyncIterable, AsyncIterator, Callable
from typing import Any

import grpc
from google.protobuf import json_format

from dsmesh.v1 import generation_pb2 as pb
from dsmesh.v1 import generation_pb2_grpc

BACKENDS = ("grpc", "rest", "openai", "offline")

# A failed request's outcome, apart from plain failures: refused for lack of room (gRPC
# RESOURCE_EXHAUSTED, HTTP 429), or past a deadline (the client's, or the server's).
FAILED, REFUSED, TIMED_OUT = "failed", "refused", "timed_out"
_STATUS_OUTCOMES = {"RESOURCE_EXHAUSTED": REFUSED, "DEADLINE_EXCEEDED": TIMED_OUT}
_HTTP_OUTCOMES = {429: REFUSED, 408: TIMED_OUT, 504: TIMED_OUT}


class BenchError(Exception):
    """The benchmark cannot run at all (server unreachable, warm-up failed)."""


class RequestError(Exception):
    """One request failed; the message goes into its record and the report, ``outcome``
    (FAILED, REFUSED or TIMED_OUT) into its record's outcome."""

    def __init__(self, message: str, outcome: str = FAILED) -> None:
        super().__init__(message)
        self.outcome = outcome


def status_outcome(status_name: str) -> str:
    """The outcome of a request that ended with the gRPC status ``status_name``."""
    return _STATUS_OUTCOMES.get(status_name, FAILED)


def http_outcome(status: int) -> str:
    """The outcome of a request answered with HTTP ``status`` (not 2xx)."""
    return _HTTP_OUTCOMES.get(status, FAILED)


def _error_event_outcome(data: str) -> str:
    """The outcome of an SSE ``error`` event: its ``error.status`` (a gRPC status name)."""
    try:
        error = json.loads(data).get("error", {})
    except (ValueError, AttributeError):
        return FAILED
    return status_outcome(error.get("status", "")) if isinstance(error, dict) else FAILED


class Backend(ABC):
    """A connection to one server. ``connect`` once, then ``generate`` from many tasks at
    once, then ``close`` once."""

    # Whether each message carries its token ids. False (OpenAI's chunks carry text): a
    # message with text counts as one token, and the last message's usage gives the total.
    sends_token_ids: bool = True

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
            name = exc.code().name
            raise RequestError(f"{name}: {exc.details()}", status_outcome(name)) from exc

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


async def _check_status(resp: Any) -> None:
    """Raise RequestError for an HTTP answer other than 2xx (an aiohttp response)."""
    if resp.status // 100 != 2:
        text = (await resp.text()).strip()
        raise RequestError(f"HTTP {resp.status}: {text[:500]}", http_outcome(resp.status))


async def _sse_post(
    session: Any,
    url: str,
    body: str,
    timeout_s: float,
    parse: Callable[[str], pb.GenerateResponse],
    parse_error: type[Exception],
) -> AsyncIterator[pb.GenerateResponse]:
    """POST ``body`` and yield each server-sent event's data through ``parse`` until the
    stream ends; an HTTP error, an error event, a timeout or bad data raise RequestError."""
    import aiohttp

    headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
    try:
        async with session.post(
            url, data=body, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as resp:
            await _check_status(resp)
            async for event, data in sse_events(resp.content):
                _check_event(event, data)
                if data.strip() == "[DONE]":
                    continue
                yield parse(data)
    except TimeoutError as exc:
        raise RequestError(f"TimeoutError: no answer in {timeout_s:g} s", TIMED_OUT) from exc
    except (aiohttp.ClientError, parse_error) as exc:
        raise RequestError(f"{type(exc).__name__}: {exc}") from exc


def _check_event(event: str, data: str) -> None:
    """Raise RequestError for an SSE ``error`` event (a failure after the stream began)."""
    if event == "error":
        raise RequestError(f"error event: {data[:500]}", _error_event_outcome(data))


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
        def parse(data: str) -> pb.GenerateResponse:
            return json_format.Parse(data, pb.GenerateResponse(), ignore_unknown_fields=True)

        url, body = f"{self._url}/v1/generate", request_json(request)
        stream = _sse_post(self._session, url, body, timeout_s, parse, json_format.ParseError)
        async for message in stream:
            yield message

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


def completions_body(request: pb.GenerateRequest, model: str) -> dict[str, Any]:
    """The ``/v1/completions`` body of ``request``, as an OpenAI client sends it: the prompt
    as token ids (or text), streamed with the usage at the end; ``max_tokens`` only when
    ``sampling.max_new_tokens`` is set (unset: the server's default, up to the context
    limit); ``ignore_eos`` (vLLM's extension, which dsmesh takes) only when set."""
    s = request.sampling
    body: dict[str, Any] = {
        "model": model,
        "prompt": list(request.input_ids) or request.text,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if s.HasField("max_new_tokens"):
        body["max_tokens"] = s.max_new_tokens
    if s.HasField("temperature"):
        body["temperature"] = s.temperature
    if s.HasField("seed"):
        body["seed"] = s.seed
    if s.ignore_eos:
        body["ignore_eos"] = True
    return body


def completions_chunk(chunk: dict[str, Any]) -> pb.GenerateResponse:
    """One streamed ``text_completion`` chunk as a message: its text, finish reason and (on
    the last chunk, which has no choices) the usage."""
    msg = pb.GenerateResponse(request_id=chunk.get("id", ""))
    for choice in chunk.get("choices") or []:
        msg.text += choice.get("text") or ""
        msg.finish_reason = choice.get("finish_reason") or msg.finish_reason
    usage = chunk.get("usage")
    if usage:
        msg.usage.prompt_tokens = usage.get("prompt_tokens", 0)
        msg.usage.completion_tokens = usage.get("completion_tokens", 0)
        details = usage.get("prompt_tokens_details") or {}
        msg.usage.cached_tokens = details.get("cached_tokens") or 0
    return msg


class OpenAIBackend(RestBackend):
    """``POST /v1/completions`` streamed as SSE (:func:`completions_body`), the route OpenAI
    clients use; the model is the first ``/v1/models`` lists. Chunks carry text, not token
    ids: each chunk with text counts as one token, and the usage gives the total."""

    sends_token_ids = False

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self._model = ""

    async def connect(self, timeout_s: float) -> None:
        import aiohttp

        await super().connect(timeout_s)
        try:
            timeout = aiohttp.ClientTimeout(total=timeout_s)
            async with self._session.get(f"{self._url}/v1/models", timeout=timeout) as resp:
                models = (await resp.json())["data"]
            self._model = models[0]["id"]
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, IndexError) as exc:
            raise BenchError(f"no model listed at {self._url}/v1/models: {exc!r}") from None

    async def generate(
        self, request: pb.GenerateRequest, timeout_s: float
    ) -> AsyncIterator[pb.GenerateResponse]:
        def parse(data: str) -> pb.GenerateResponse:
            return completions_chunk(json.loads(data))

        url = f"{self._url}/v1/completions"
        body = json.dumps(completions_body(request, self._model))
        async for message in _sse_post(self._session, url, body, timeout_s, parse, ValueError):
            yield message
