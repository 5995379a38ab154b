"""A minimal double of the gateway's public protocol: ``Generation.Generate`` over a real
grpc.aio server, and ``POST /v1/generate`` with SSE and OpenAI's ``/v1/models`` and streamed
``/v1/completions`` over a real aiohttp server.

It streams ``max_new_tokens`` tokens (token id = position) in messages of up to
``TOKENS_PER_MESSAGE`` tokens, a short sleep apart; the last message has ``finish_reason``
"length" and ``usage``. Text prompts count one token per word. A token id outside
``[0, VOCAB_SIZE)`` is refused with INVALID_ARGUMENT / HTTP 400. Both servers run on an
event loop of their own thread, so tests can drive the CLI (which runs its own loop).

``/v1/completions`` streams ``max_tokens`` tokens, or without it up to ``CONTEXT`` tokens of
prompt and output (as the gateway's "up to the context limit"), ``TOKENS_PER_MESSAGE`` a
chunk (text only, as OpenAI's), then the usage; every body it got is kept in
``FakeGateway.completions_bodies``. A prompt starting with ``REFUSE_TOKEN`` is refused with
HTTP 429; one starting with ``DEADLINE_TOKEN`` gets an SSE error event (DEADLINE_EXCEEDED)
after its first chunk.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import grpc
from aiohttp import web
from google.protobuf import json_format

from dsmesh.v1 import generation_pb2 as pb
from dsmesh.v1 import generation_pb2_grpc

VOCAB_SIZE = 1000
TOKENS_PER_MESSAGE = 2
MESSAGE_GAP_S = 0.002
CONTEXT = 40
MODEL = "fake-model"
REFUSE_TOKEN = 998
DEADLINE_TOKEN = 997
BODIES = web.AppKey("bodies", list)


def invalid_argument(request: pb.GenerateRequest) -> str | None:
    if not request.input_ids and not request.text:
        return "input_ids or text is required"
    for i, token in enumerate(request.input_ids):
        if not 0 <= token < VOCAB_SIZE:
            return f"input_ids[{i}] = {token} out of range [0, {VOCAB_SIZE})"
    return None


async def responses(request: pb.GenerateRequest) -> AsyncIterator[pb.GenerateResponse]:
    prompt_tokens = len(request.input_ids) or len(request.text.split())
    total = request.sampling.max_new_tokens
    for start in range(0, total, TOKENS_PER_MESSAGE):
        await asyncio.sleep(MESSAGE_GAP_S)
        ids = list(range(start, min(start + TOKENS_PER_MESSAGE, total)))
        last = start + len(ids) == total
        yield pb.GenerateResponse(
            request_id="fake",
            token_ids=ids,
            finish_reason="length" if last else "",
            usage=pb.Usage(prompt_tokens=prompt_tokens, completion_tokens=total) if last else None,
        )


class FakeGeneration(generation_pb2_grpc.GenerationServicer):
    async def Generate(self, request, context):  # noqa: N802 - the proto's method name
        error = invalid_argument(request)
        if error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, error)
        async for response in responses(request):
            yield response


async def rest_generate(http_request: web.Request) -> web.StreamResponse:
    request = json_format.Parse(await http_request.text(), pb.GenerateRequest())
    error = invalid_argument(request)
    if error:
        return web.json_response({"error": error}, status=400)
    out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await out.prepare(http_request)
    async for response in responses(request):
        # Default JSON mapping (camelCase names), as a transcoding gateway would send it.
        data = json.dumps(json_format.MessageToDict(response))
        await out.write(f"data: {data}\n\n".encode())
    await out.write_eof()
    return out


async def health(_: web.Request) -> web.Response:
    return web.Response(text="ok")


async def models(_: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})


def _chunk(choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> bytes:
    body = {"id": "cmpl-fake", "object": "text_completion", "model": MODEL, "choices": choices}
    body["usage"] = usage
    return f"data: {json.dumps(body)}\n\n".encode()


async def completions(http_request: web.Request) -> web.StreamResponse:
    body = await http_request.json()
    http_request.app[BODIES].append(body)
    prompt = body["prompt"]
    if prompt[0] == REFUSE_TOKEN:
        error = {"message": "the gateway queue is full", "type": "rate_limit_error"}
        return web.json_response({"error": error}, status=429)
    total = body.get("max_tokens", CONTEXT - len(prompt))
    out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await out.prepare(http_request)
    for start in range(0, total, TOKENS_PER_MESSAGE):
        await asyncio.sleep(MESSAGE_GAP_S)
        if start and prompt[0] == DEADLINE_TOKEN:
            error = {"code": 504, "status": "DEADLINE_EXCEEDED", "message": "too slow"}
            await out.write(f"event: error\ndata: {json.dumps({'error': error})}\n\n".encode())
            break
        n = min(TOKENS_PER_MESSAGE, total - start)
        last = start + n == total
        choice = {"index": 0, "text": "x" * n, "finish_reason": "length" if last else None}
        await out.write(_chunk([choice]))
        if last:
            usage = {"prompt_tokens": len(prompt), "completion_tokens": total}
            await out.write(_chunk([], {**usage, "total_tokens": len(prompt) + total}))
    await out.write(b"data: [DONE]\n\n")
    await out.write_eof()
    return out


@dataclass(frozen=True)
class FakeGateway:
    grpc_addr: str
    url: str
    completions_bodies: list[dict[str, Any]] = field(default_factory=list)


@contextmanager
def running_fake_gateway() -> Iterator[FakeGateway]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    bodies: list[dict[str, Any]] = []

    async def start() -> tuple[grpc.aio.Server, web.AppRunner, int, int]:
        server = grpc.aio.server()
        generation_pb2_grpc.add_GenerationServicer_to_server(FakeGeneration(), server)
        grpc_port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        app = web.Application()
        app.router.add_post("/v1/generate", rest_generate)
        app.router.add_get("/health", health)
        app.router.add_get("/v1/models", models)
        app.router.add_post("/v1/completions", completions)
        app[BODIES] = bodies
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        http_port = site._server.sockets[0].getsockname()[1]  # port 0 picked a free one
        return server, runner, grpc_port, http_port

    async def stop(server: grpc.aio.Server, runner: web.AppRunner) -> None:
        await server.stop(grace=0.5)
        await runner.cleanup()

    server, runner, grpc_port, http_port = asyncio.run_coroutine_threadsafe(start(), loop).result(
        10
    )
    try:
        yield FakeGateway(f"127.0.0.1:{grpc_port}", f"http://127.0.0.1:{http_port}", bodies)
    finally:
        asyncio.run_coroutine_threadsafe(stop(server, runner), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
