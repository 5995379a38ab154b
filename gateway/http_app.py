"""The gateway's HTTP side: transcoded REST, OpenAI routes, /health and /metrics."""

from __future__ import annotations

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from dsmesh.telemetry import context_from_headers
from dsmesh.v1 import generation_pb2
from gateway import api
from gateway.core import GenerationCore
from gateway.openai_api import OpenAIRoutes
from gateway.rest import transcoded_routes


def build_app(core: GenerationCore, model_name: str, max_body_bytes: int) -> web.Application:
    app = web.Application(client_max_size=max_body_bytes)
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
    app.add_routes(OpenAIRoutes(core, model_name).routes())

    async def health(request: web.Request) -> web.Response:
        reg = core.registry
        if reg.is_healthy():
            return web.json_response({"status": "ok"})
        from dsmesh.v1 import kv_broker_pb2 as kb

        detail = {
            "kv_broker": reg.broker_ok,
            "prefill": len(reg.healthy_of(kb.ROLE_PREFILL)),
            "decode": len(reg.healthy_of(kb.ROLE_DECODE)),
        }
        return web.json_response({"status": "unavailable", **detail}, status=503)

    async def metrics(request: web.Request) -> web.Response:
        body = generate_latest(core.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    app.add_routes([web.get("/health", health), web.get("/metrics", metrics)])
    return app
