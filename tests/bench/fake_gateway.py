"""A minimal double of the gateway's public protocol: ``Generation.Generate`` over a real
grpc.aio server and ``POST /v1/generate`` with SSE over a real aiohttp server.

It streams ``max_new_tokens`` tokens (token id = position) in messages of up to
``TOKENS_PER_MESSAGE`` tokens, a short sleep apart; the last message has ``finish_reason``
"length" and ``usage``. Text prompts count one token per word. A token id outside
``[0, VOCAB_SIZE)`` is refused with INVALID_ARGUMENT / HTTP 400. Both servers run on an
event loop of their own thread, so tests can drive the CLI (which runs its own loop).
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import grpc
from aiohttp import web
from google.protobuf import json_format

from dsmesh.v1 import generation_pb2 as pb
from dsmesh.v1 import generation_pb2_grpc

VOCAB_SIZE = 1000
TOKENS_PER_MESSAGE = 2
MESSAGE_GAP_S = 0.002


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


@dataclass(frozen=True)
class FakeGateway:
    grpc_addr: str
    url: str


@contextmanager
def running_fake_gateway() -> Iterator[FakeGateway]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def start() -> tuple[grpc.aio.Server, web.AppRunner, int, int]:
        server = grpc.aio.server()
        generation_pb2_grpc.add_GenerationServicer_to_server(FakeGeneration(), server)
        grpc_port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        app = web.Application()
        app.router.add_post("/v1/generate", rest_generate)
        app.router.add_get("/health", health)
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
        yield FakeGateway(f"127.0.0.1:{grpc_port}", f"http://127.0.0.1:{http_port}")
    finally:
        asyncio.run_coroutine_threadsafe(stop(server, runner), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
