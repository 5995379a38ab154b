"""What a kv_broker process is told at start-up: each field is a flag of ``dsmesh kv-broker``
(dsmesh/options/fields.py)."""

from __future__ import annotations

from dataclasses import dataclass

from dsmesh.options import parse as argtypes
from dsmesh.options.fields import option
from dsmesh.runtime.server_options import ServerOptions, metrics_port_option, port_option

DEFAULT_PORT = 50054  # the CLI's default; BrokerConfig's 0 picks any free port


@dataclass(frozen=True)
class BrokerConfig(ServerOptions):
    port: int = port_option(DEFAULT_PORT)  # 0: any free port (reported through ``ready``)
    handoff_timeout_s: float = option(
        30.0,
        "whole-handoff deadline when Reserve sets no timeout_ms",
        parse=argtypes.seconds,
        metavar="SECONDS",
    )
    heartbeat_interval_s: float = option(
        1.0, "heartbeat period on idle Attach streams", parse=argtypes.seconds, metavar="SECONDS"
    )
    liveness_grace_s: float = option(
        2.0,
        "how long an instance whose Attach stream ended may re-attach before its handoffs fail",
        parse=argtypes.seconds_or_zero,
        metavar="SECONDS",
        up=True,
    )
    terminal_ttl_s: float = option(
        60.0,
        "how long finished handoffs stay queryable (Get, Await)",
        parse=argtypes.seconds,
        metavar="SECONDS",
    )
    metrics_port: int = metrics_port_option()

    def __post_init__(self) -> None:
        super().__post_init__()
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
