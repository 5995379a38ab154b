"""``dsmesh kv-broker``: run the KV handoff broker (prefill/decode rendezvous and liveness)."""

from __future__ import annotations

import argparse

from dsmesh.cli_common import add_security_args, tls_config_from
from dsmesh.grpc_server import run_until_signal
from kv_broker.service import DEFAULT_PORT, BrokerConfig, serve


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def _seconds(text: str) -> float:
    value = _number(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def _grace(text: str) -> float:
    value = _number(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must not be negative, got {text}")
    return value


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be in 0..65535, got {text}")
    return value


def register(sub: argparse._SubParsersAction) -> None:
    d = BrokerConfig()
    p = sub.add_parser(
        "kv-broker",
        help="run the KV handoff broker between prefill and decode instances",
        description=(
            "Serve dsmesh.v1.KVBroker: the per-request handoff state machine (RESERVED -> "
            "TRANSFERRING -> DONE/FAILED/ABORTED/TIMED_OUT) and the liveness of attached "
            "prefill/decode instances. Prints 'kv-broker listening on HOST:PORT' once ready; "
            "SIGTERM/SIGINT stop it gracefully."
        ),
    )
    p.add_argument("--host", default=d.host, help=f"address to bind (default {d.host})")
    p.add_argument(
        "--port",
        type=_port,
        default=DEFAULT_PORT,
        help=f"gRPC port (default {DEFAULT_PORT}; 0 picks any free port)",
    )
    p.add_argument(
        "--handoff-timeout",
        type=_seconds,
        default=d.handoff_timeout_s,
        metavar="SECONDS",
        help="whole-handoff deadline when Reserve sets no timeout_ms "
        f"(default {d.handoff_timeout_s:g})",
    )
    p.add_argument(
        "--heartbeat-interval",
        type=_seconds,
        default=d.heartbeat_interval_s,
        metavar="SECONDS",
        help=f"heartbeat period on idle Attach streams (default {d.heartbeat_interval_s:g})",
    )
    p.add_argument(
        "--liveness-grace",
        type=_grace,
        default=d.liveness_grace_s,
        metavar="SECONDS",
        help="how long an instance whose Attach stream ended may re-attach before its "
        f"handoffs fail (default {d.liveness_grace_s:g})",
    )
    p.add_argument(
        "--terminal-ttl",
        type=_seconds,
        default=d.terminal_ttl_s,
        metavar="SECONDS",
        help=f"how long finished handoffs stay queryable (default {d.terminal_ttl_s:g})",
    )
    p.add_argument(
        "--metrics-port",
        type=_port,
        default=d.metrics_port,
        help="serve Prometheus /metrics on this port (default 0: off)",
    )
    add_security_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    config = BrokerConfig(
        host=args.host,
        port=args.port,
        handoff_timeout_s=args.handoff_timeout,
        heartbeat_interval_s=args.heartbeat_interval,
        liveness_grace_s=args.liveness_grace,
        terminal_ttl_s=args.terminal_ttl,
        metrics_port=args.metrics_port,
        tls=tls_config_from(args),
        max_message_bytes=args.max_message_bytes,
    )

    def ready(port: int) -> None:
        print(f"kv-broker listening on {config.host}:{port}", flush=True)

    run_until_signal(lambda stop: serve(config, stop, ready))
    return 0
