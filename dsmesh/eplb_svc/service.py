"""The eplb process: its config and :func:`serve`."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from dsmesh.eplb_svc.config import EPLBConfig
from dsmesh.eplb_svc.metrics import EPLBMetrics
from dsmesh.eplb_svc.servicer import EPLBServicer
from dsmesh.runtime.drain import Drain
from dsmesh.runtime.grpc_server import method_paths
from dsmesh.runtime.lifecycle import serve_control_plane
from dsmesh.v1 import eplb_pb2, eplb_pb2_grpc

_SERVICE = eplb_pb2.DESCRIPTOR.services_by_name["EPLB"]
SERVICE_NAME = _SERVICE.full_name
# A draining EPLB takes no new call. Instances hold their streams open for their whole
# life, so a drain does not wait for those.
_REFUSED = method_paths(_SERVICE)
_STREAMS = method_paths(_SERVICE, "ReportLoad", "WatchPlacement")


async def serve(
    config: EPLBConfig,
    stop: asyncio.Event,
    ready: Callable[[int], None] | None = None,
    metrics: EPLBMetrics | None = None,
) -> None:
    """Serve ``dsmesh.v1.EPLB`` (plus health and reflection) until ``stop`` is set.

    ``ready(port)`` is called once the server accepts calls. On stop: health goes
    NOT_SERVING, new calls get UNAVAILABLE, calls in flight get ``config.drain_timeout_s``,
    then WatchPlacement streams end with OK. ``metrics`` (tests) defaults to a fresh registry.
    """
    metrics = metrics if metrics is not None else EPLBMetrics()
    servicer = EPLBServicer(config, metrics)
    await serve_control_plane(
        "eplb",
        SERVICE_NAME,
        lambda server: eplb_pb2_grpc.add_EPLBServicer_to_server(servicer, server),
        servicer,
        metrics.registry,
        config,
        stop,
        Drain(_REFUSED, untracked=_STREAMS),
        ready,
    )
