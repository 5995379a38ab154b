"""The gateway's HTTP side: transcoded REST, OpenAI routes, /health and /metrics."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

import grpc
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from dsmesh.gateway import api
from dsmesh.gateway.core import GenerationCore
from dsmesh.gateway.openai_api import OpenAIError, OpenAIRoutes, is_openai_path
from dsmesh.gateway.responses_api import ResponsesRoutes
from dsmesh.gateway.rest import error_response, transcoded_routes
from dsmesh.gateway.sglang_api import SGLangRoutes
from dsmesh.runtime.drain import DRAINING_MESSAGE, Drain
from dsmesh.runtime.security import bearer_matches
from dsmesh.runtime.telemetry import context_from_headers
from dsmesh.v1 import generation_pb2

OPEN_PATHS = frozenset({"/health", "/metrics"})  # no API key needed: probes and scrapers
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def build_app(
    core: GenerationCore,
    model_name: str | Sequence[str],
    max_body_bytes: int,
    api_keys: Sequence[str] = (),
    drain: Drain | None = None,
    reasoning_parser: str = "",
    unknown_fields: str = "error",
) -> web.Application:
    """``api_keys`` non-empty: every route but /health and /metrics needs
    ``Authorization: Bearer <key>`` (401 otherwise). A body over ``max_body_bytes`` is 413.
    ``drain`` (shared with the gRPC port) counts requests in flight; once it drains, new
    requests get 503 and /health answers 503 ``draining``. ``reasoning_parser``: "" (off) or
    a dsmesh/gateway/reasoning.py parser for chat completions' ``reasoning_content``.
    ``unknown_fields``: what an OpenAI request field the gateway does not know gets, ``error``
    (400 naming it) or ``ignore`` (dsmesh/gateway/openai_fields.py)."""
    drain = drain if drain is not None else Drain()
    openai = OpenAIRoutes(core, model_name, reasoning_parser, unknown_fields)
    middlewares = [admit(drain), body_limit(max_body_bytes), unrouted]
    if api_keys:
        middlewares.insert(0, require_api_key(tuple(api_keys)))  # before reading
    app = web.Application(client_max_size=max_body_bytes, middlewares=middlewares)
    service = generation_pb2.DESCRIPTOR.services_by_name["Generation"]
    app.add_routes(
        transcoded_routes(
            service,
            streaming={
                "Generate": (
                    lambda m, r: api.generate(core, m, context_from_headers(r.headers)),
                    api.aggregate,
                )
            },
            unary={"Abort": lambda m, r: api.abort(core, m)},
        )
    )
    app.add_routes(openai.routes())
    app.add_routes(ResponsesRoutes(openai).routes())  # OpenAI's Responses API
    app.add_routes(SGLangRoutes(core).routes())  # SGLang's native /generate

    async def health(request: web.Request) -> web.Response:
        reg = core.registry
        if drain.draining:
            return web.json_response({"status": "draining"}, status=503)
        if reg.is_healthy():
            return web.json_response({"status": "ok"})
        from dsmesh.v1 import kv_broker_pb2 as kb

        detail = {
            "kv_broker": reg.broker_ok,
            "prefill": len(reg.healthy_of(kb.ROLE_PREFILL)),
            "decode": len(reg.healthy_of(kb.ROLE_DECODE)),
            "unified": len(reg.healthy_of(kb.ROLE_UNIFIED)),
        }
        return web.json_response({"status": "unavailable", **detail}, status=503)

    async def metrics(request: web.Request) -> web.Response:
        body = generate_latest(core.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    app.add_routes([web.get("/health", health), web.get("/metrics", metrics)])
    return app


def require_api_key(keys: tuple[str, ...]):
    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path in OPEN_PATHS or bearer_matches(request.headers.get("Authorization"), keys):
            return await handler(request)
        message = "missing or invalid API key: send 'Authorization: Bearer <key>'"
        if is_openai_path(request.path):
            resp = OpenAIError(
                401, message, code="invalid_api_key", kind="authentication_error"
            ).response()
        else:
            resp = error_response(grpc.StatusCode.UNAUTHENTICATED, message)
        resp.headers["WWW-Authenticate"] = "Bearer"
        return resp

    return middleware


def admit(drain: Drain):
    """Counts requests in flight for the drain; once draining, new ones get 503."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path in OPEN_PATHS:
            return await handler(request)
        if drain.draining:
            if is_openai_path(request.path):
                resp = OpenAIError(
                    503, DRAINING_MESSAGE, code="service_unavailable", kind="server_error"
                ).response()
            else:
                resp = error_response(grpc.StatusCode.UNAVAILABLE, DRAINING_MESSAGE)
            resp.headers["Retry-After"] = "1"
            return resp
        with drain.track():
            return await handler(request)

    return middleware


def body_limit(max_body_bytes: int):
    """Reads the body up front (the handlers find it cached) so that one over the limit is a
    413 with a JSON error instead of a failure inside a handler."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.can_read_body:
            size = request.content_length
            too_large = size is not None and size > max_body_bytes
            if not too_large:
                try:
                    await request.read()
                except web.HTTPRequestEntityTooLarge:
                    too_large = True
            if too_large:
                return _too_large(is_openai_path(request.path), max_body_bytes)
        return await handler(request)

    return middleware


@web.middleware
async def unrouted(request: web.Request, handler: Handler) -> web.StreamResponse:
    """An unknown path (404) or a method a route does not take (405, with ``Allow``) answers
    with OpenAI's error JSON rather than aiohttp's plain text."""
    exc = request.match_info.http_exception
    if exc is None:
        return await handler(request)
    if exc.status == 405:
        allowed = exc.headers.get("Allow", "")
        message = f"{request.method} is not allowed on {request.path} (allowed: {allowed})"
        resp = OpenAIError(405, message, code="method_not_allowed").response()
        resp.headers["Allow"] = allowed
        return resp
    message = f"Unknown route: {request.method} {request.path}"
    return OpenAIError(exc.status, message, code="not_found").response()


def _too_large(openai: bool, max_body_bytes: int) -> web.Response:
    message = f"request body is larger than the limit of {max_body_bytes} bytes"
    if openai:
        return OpenAIError(413, message, code="request_too_large").response()
    # RESOURCE_EXHAUSTED: what gRPC answers for a message over its limit
    body = {"error": {"code": 413, "status": "RESOURCE_EXHAUSTED", "message": message}}
    return web.json_response(body, status=413)
