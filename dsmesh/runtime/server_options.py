"""The options every server process takes: where it binds, what its peers dial, TLS, message
size, and its drain on SIGTERM. Each service's config inherits them (dsmesh/options/fields.py)
and declares its own ports with :func:`port_option` and :func:`metrics_port_option`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dsmesh.options import parse as argtypes
from dsmesh.options.fields import option
from dsmesh.runtime.address import LOOPBACK
from dsmesh.runtime.lifecycle import DEFAULT_DRAIN_TIMEOUT_S, check_drain_timeout
from dsmesh.runtime.security import SecurityOptions


@dataclass(frozen=True, kw_only=True)
class ServerOptions(SecurityOptions):
    host: str = option(LOOPBACK, "address to bind (0.0.0.0 or :: for every interface)")
    # empty: from ``host`` (dsmesh.runtime.address.advertise_host), resolved by the CLI
    advertise_host: str = option(
        "",
        "address peers dial to reach this process, registered with kv_broker and printed in "
        "the 'listening on' line (docs/DEPLOY.md, 'Addresses')",
        metavar="HOST",
        default_text="--host, or the address of the default route's interface when --host "
        "binds every interface",
    )
    drain_timeout_s: float = option(
        DEFAULT_DRAIN_TIMEOUT_S,
        "on SIGTERM: stop admitting (health NOT_SERVING, new requests UNAVAILABLE) and give "
        "the requests in flight this long to finish",
        parse=argtypes.seconds_or_zero,
        metavar="SECONDS",
    )

    def __post_init__(self) -> None:
        check_drain_timeout(self.drain_timeout_s)
        if self.max_message_bytes < 1:
            raise ValueError(f"max_message_bytes must be positive, got {self.max_message_bytes}")


def port_option(cli_default: int = 0) -> Any:
    """A server's gRPC port field: 0 in the config (any free port, reported when ready),
    ``cli_default`` on the command line."""
    return option(0, "gRPC port (0 = any free port)", parse=argtypes.port, cli_default=cli_default)


def metrics_port_option() -> Any:
    """A server's Prometheus port field (0 = off)."""
    return option(0, "serve Prometheus /metrics on this port (0 = off)", parse=argtypes.port)
