"""What an eplb process is told at start-up."""

from __future__ import annotations

import math
from dataclasses import dataclass

from dsmesh.runtime.lifecycle import check_drain_timeout
from dsmesh.runtime.security import DEFAULT_MAX_MESSAGE_BYTES, TLSConfig

DEFAULT_PORT = 50055  # the CLI's default; EPLBConfig's 0 picks any free port


@dataclass(frozen=True)
class EPLBConfig:
    host: str = "127.0.0.1"  # the address bound
    advertise_host: str = ""  # what peers dial; empty: from ``host`` (dsmesh.runtime.address)
    port: int = 0  # 0: any free port (reported through ``ready``)
    interval_s: float = 60.0  # periodic rebalance of every instance with load
    threshold: float = 0.05  # apply when predicted balancedness rises by more than this
    window_steps: int = 1000  # engine steps of load each instance's window keeps
    metrics_port: int = 0  # Prometheus /metrics on host:metrics_port; 0 = off
    drain_timeout_s: float = 2.0  # calls in flight get this long after a stop
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
        check_drain_timeout(self.drain_timeout_s)
        if self.max_message_bytes < 1:
            raise ValueError(f"max_message_bytes must be positive, got {self.max_message_bytes}")
