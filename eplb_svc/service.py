"""The eplb process: its config and :func:`serve`."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from dataclasses import dataclass

from dsmesh.security import DEFAULT_MAX_MESSAGE_BYTES, TLSConfig
from dsmesh.service_loop import serve_until_stopped
from dsmesh.v1 import eplb_pb2, eplb_pb2_grpc
from eplb_svc.metrics import EPLBMetrics
from eplb_svc.servicer import EPLBServicer

SERVICE_NAME = eplb_pb2.DESCRIPTOR.services_by_name["EPLB"].full_name
DEFAULT_PORT = 50055  # the CLI's default; EPLBConfig's 0 picks any free port


@dataclass(frozen=True)
class EPLBConfig:
    host: str = "127.0.0.1"
    port: int = 0  # 0: any free port (reported through ``ready``)
    interval_s: float = 60.0  # periodic rebalance of every instance with load
    threshold: float = 0.05  # apply when predicted balancedness rises by more than this
    window_steps: int = 1000  # engine steps of load each instance's window keeps
    metrics_port: int = 0  # Prometheus /metrics on host:metrics_port; 0 = off
    shutdown_grace_s: float = 2.0
    tls: TLSConfig = TLSConfig()
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES

    def __post_init__(self) -> None:
        for name in ("port", "metrics_port"):
            value = getattr(self, name)
            if not 0 <= value <= 65535:
                raise ValueError(f"{name} must be in 0..65535, got {value}")
        if not (math.isfinite(self.interval_s) and self.interval_s > 0):
            raise ValueError(f"interval_s must be positive, got {self.interval_s}")
        if not (math.isfinite(self.threshold) and 0 <= self.threshold < 1):
            raise ValueError(f"threshold must be in [0, 1), got {self.threshold}")
        if self.window_steps < 1:
            raise ValueError(f"window_steps must be >= 1, got {self.window_steps}")
        if self.shutdown_grace_s < 0:
            raise ValueError(f"shutdown_grace_s must not be negative: {self.shutdown_grace_s}")
        if self.max_message_bytes < 1:
            raise ValueError(f"max_message_bytes must be positive, got {self.max_message_bytes}")


async def serve(
    config: EPLBConfig,
    stop: asyncio.Event,
    ready: Callable[[int], None] | None = None,
    metrics: EPLBMetrics | None = None,
) -> None:
    """Serve ``dsmesh.v1.EPLB`` (plus health and reflection) until ``stop`` is set.

    ``ready(port)`` is called once the server accepts calls. On stop: health goes
    NOT_SERVING, WatchPlacement streams end with OK, in-flight calls get
    ``config.shutdown_grace_s``. ``metrics`` (tests) defaults to a fresh registry.
    """
    metrics = metrics if metrics is not None else EPLBMetrics()
    servicer = EPLBServicer(config, metrics)
    await serve_until_stopped(
        "eplb",
        SERVICE_NAME,
        lambda server: eplb_pb2_grpc.add_EPLBServicer_to_server(servicer, server),
        servicer,
        metrics.registry,
        config,
        stop,
        ready,
    )
