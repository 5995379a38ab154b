"""A Prometheus ``/metrics`` endpoint for the life of a service (prometheus-client's server)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from prometheus_client import CollectorRegistry, start_http_server

log = logging.getLogger(__name__)


@contextlib.asynccontextmanager
async def metrics_endpoint(
    registry: CollectorRegistry, port: int, host: str, service: str
) -> AsyncIterator[None]:
    """Serve ``registry`` on ``http://host:port/metrics`` inside the block; ``port`` 0 = off."""
    if port <= 0:
        yield
        return
    server, _ = start_http_server(port, addr=host, registry=registry)
    log.info("%s metrics on http://%s:%d/metrics", service, host, port)
    try:
        yield
    finally:
        await asyncio.to_thread(server.shutdown)  # blocks up to its 0.5 s poll
        server.server_close()
