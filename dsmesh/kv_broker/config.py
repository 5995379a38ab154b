"""What a kv_broker process is told at start-up."""

from __future__ import annotations

from dataclasses import dataclass

from dsmesh.runtime.lifecycle import DEFAULT_DRAIN_TIMEOUT_S, check_drain_timeout
from dsmesh.runtime.security import DEFAULT_MAX_MESSAGE_BYTES, TLSConfig

DEFAULT_PORT = 50054  # the CLI's default; BrokerConfig's 0 picks any free port


@dataclass(frozen=True)
class BrokerConfig:
    host: str = "127.0.0.1"  # the address bound
    advertise_host: str = ""  # what peers dial; empty: from ``host`` (dsmesh.runtime.address)
    port: int = 0  # 0: any free port (reported through ``ready``)
    handoff_timeout_s: float = 30.0  # whole-handoff deadline when Reserve gives none
    heartbeat_interval_s: float = 1.0  # heartbeat events on idle Attach streams
    liveness_grace_s: float = 2.0  # time to re-attach before an instance counts as lost
    terminal_ttl_s: float = 60.0  # how long finished handoffs stay readable (Get, Await)
    metrics_port: int = 0  # Prometheus /metrics on host:metrics_port; 0 = off
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S  # live handoffs get this long after a stop
    tls: TLSConfig = TLSConfig()  # TLS / mTLS on the server; off by default
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES

    def __post_init__(self) -> None:
        if self.max_message_bytes < 1:
            raise ValueError(f"max_message_bytes must be positive, got {self.max_message_bytes}")
        for name in ("port", "metrics_port"):
            value = getattr(self, name)
            if not 0 <= value <= 65535:
                raise ValueError(f"{name} must be in 0..65535, got {value}")
        for name in ("handoff_timeout_s", "heartbeat_interval_s", "terminal_ttl_s"):
            value = getattr(self, name)
            if value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        for name in ("liveness_grace_s",):
            value = getattr(self, name)
            if value < 0:
                raise ValueError(f"{name} must not be negative, got {value}")
        check_drain_timeout(self.drain_timeout_s)
