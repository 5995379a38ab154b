"""REST routes transcoded from the proto's ``google.api.http`` annotations.

JSON bodies map onto request messages with protobuf's JSON mapping. A server-streaming
method answers with Server-Sent Events when the request's ``stream`` field is true, else
with one aggregated JSON object. Errors carry the gRPC status name and the HTTP equivalent.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from aiohttp import web
from google.api import annotations_pb2
from google.protobuf import json_format, message_factory
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message import Message

from dsmesh.gateway.core import GatewayError

log = logging.getLogger(__name__)

HTTP_STATUS = {
    grpc.StatusCode.OK: 200,
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ABORTED: 409,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}

# handlers get the parsed message and the HTTP request (headers carry trace context)
StreamHandler = Callable[[Message, web.Request], AsyncIterator[Message]]
UnaryHandler = Callable[[Message, web.Request], Awaitable[Message]]
Aggregator = Callable[[list[Message]], Message]


def http_status(code: grpc.StatusCode) -> int:
    return HTTP_STATUS.get(code, 500)


def error_response(code: grpc.StatusCode, message: str) -> web.Response:
    status = http_status(code)
    headers = {"Retry-After": "1"} if status in (429, 503) else None
    body = {"error": {"code": status, "status": code.name, "message": message}}
    return web.json_response(body, status=status, headers=headers)


def to_json(msg: Message) -> dict[str, Any]:
    return json_format.MessageToDict(
        msg, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )


async def read_json(request: web.Request) -> Any:
    """Parse the body as JSON or raise GatewayError(INVALID_ARGUMENT)."""
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge as exc:
        raise GatewayError(grpc.StatusCode.INVALID_ARGUMENT, f"body: {exc.text}") from exc
    try:
        return json.loads(raw or b"{}")
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise GatewayError(
            grpc.StatusCode.INVALID_ARGUMENT, f"body: malformed JSON: {exc}"
        ) from exc


def parse_message(body: Any, cls: type[Message]) -> Message:
    if not isinstance(body, dict):
        raise GatewayError(grpc.StatusCode.INVALID_ARGUMENT, "body: must be a JSON object")
    try:
        return json_format.ParseDict(body, cls())
    except json_format.ParseError as exc:
        raise GatewayError(grpc.StatusCode.INVALID_ARGUMENT, f"body: {exc}") from exc


async def sse(
    request: web.Request,
    events: AsyncIterator[dict[str, Any]],
    done_marker: bool = False,
    early_error: Callable[[GatewayError], web.Response] | None = None,
    late_error: Callable[[GatewayError], dict[str, Any]] | None = None,
) -> web.StreamResponse:
    """Write each dict as one ``data:`` event; a failure becomes an ``error`` event (its body
    in this module's gRPC-status shape). ``early_error``: the response to a failure before
    the first event (the OpenAI routes' error JSON); None: :func:`error_response`.
    ``late_error``: the body of a failure after it, sent as a plain ``data:`` event (OpenAI's
    error object, as OpenAI streams it); None: the ``error`` event."""
    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    started = False
    try:
        async for event in events:
            if not started:
                await resp.prepare(request)
                started = True
            await resp.write(f"data: {json.dumps(event, ensure_ascii=False)}\n\n".encode())
    except GatewayError as exc:
        if not started:
            if early_error is not None:
                return early_error(exc)
            return error_response(exc.code, exc.message)
        if late_error is not None:
            await resp.write(f"data: {json.dumps(late_error(exc))}\n\n".encode())
        else:
            err = {
                "error": {
                    "code": http_status(exc.code),
                    "status": exc.code.name,
                    "message": exc.message,
                }
            }
            await resp.write(f"event: error\ndata: {json.dumps(err)}\n\n".encode())
    if not started:
        await resp.prepare(request)
    if done_marker:
        await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


def transcoded_routes(
    service: ServiceDescriptor,
    streaming: dict[str, tuple[StreamHandler, Aggregator]],
    unary: dict[str, UnaryHandler],
) -> list[web.RouteDef]:
    """aiohttp routes for every method of ``service`` that has an http annotation."""
    routes: list[web.RouteDef] = []
    for method in service.methods:
        rule = method.GetOptions().Extensions[annotations_pb2.http]
        verb = rule.WhichOneof("pattern")
        if verb is None or verb == "custom":
            continue
        path = getattr(rule, verb)
        cls = message_factory.GetMessageClass(method.input_type)
        if method.server_streaming:
            handler = _stream_route(cls, *streaming[method.name])
        else:
            handler = _unary_route(cls, unary[method.name])
        routes.append(web.route(verb.upper(), path, handler))
    return routes


def _stream_route(cls: type[Message], fn: StreamHandler, aggregate: Aggregator):
    async def handle(request: web.Request) -> web.StreamResponse:
        try:
            msg = parse_message(await read_json(request), cls)
        except GatewayError as exc:
            return error_response(exc.code, exc.message)
        wants_stream = getattr(msg, "stream", True)
        if wants_stream:
            return await sse(request, (to_json(m) async for m in fn(msg, request)))
        try:
            messages = [m async for m in fn(msg, request)]
        except GatewayError as exc:
            return error_response(exc.code, exc.message)
        return web.json_response(to_json(aggregate(messages)))

    return handle


def _unary_route(cls: type[Message], fn: UnaryHandler):
    async def handle(request: web.Request) -> web.Response:
        try:
            msg = parse_message(await read_json(request), cls)
            return web.json_response(to_json(await fn(msg, request)))
        except GatewayError as exc:
            return error_response(exc.code, exc.message)

    return handle
