"""``dsmesh kv-broker``: run the KV handoff broker (prefill/decode rendezvous and liveness)."""

from __future__ import annotations

import argparse

from dsmesh.cli.common import (
    add_drain_arg,
    add_host_args,
    add_security_args,
    run_server,
    server_fields_from,
)
from dsmesh.kv_broker.config import DEFAULT_PORT, BrokerConfig
from dsmesh.kv_broker.service import serve
from dsmesh.runtime import argtypes


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
    add_host_args(p, d.host)
    p.add_argument(
        "--port",
        type=argtypes.port,
        default=DEFAULT_PORT,
        help=f"gRPC port (default {DEFAULT_PORT}; 0 picks any free port)",
    )
    p.add_argument(
        "--handoff-timeout",
        type=argtypes.seconds,
        default=d.handoff_timeout_s,
        metavar="SECONDS",
        help="whole-handoff deadline when Reserve sets no timeout_ms "
        f"(default {d.handoff_timeout_s:g})",
    )
    p.add_argument(
        "--heartbeat-interval",
        type=argtypes.seconds,
        default=d.heartbeat_interval_s,
        metavar="SECONDS",
        help=f"heartbeat period on idle Attach streams (default {d.heartbeat_interval_s:g})",
    )
    p.add_argument(
        "--liveness-grace",
        type=argtypes.seconds_or_zero,
        default=d.liveness_grace_s,
        metavar="SECONDS",
        help="how long an instance whose Attach stream ended may re-attach before its "
        f"handoffs fail (default {d.liveness_grace_s:g})",
    )
    p.add_argument(
        "--terminal-ttl",
        type=argtypes.seconds,
        default=d.terminal_ttl_s,
        metavar="SECONDS",
        help=f"how long finished handoffs stay queryable (default {d.terminal_ttl_s:g})",
    )
    p.add_argument(
        "--metrics-port",
        type=argtypes.port,
        default=d.metrics_port,
        help="serve Prometheus /metrics on this port (default 0: off)",
    )
    add_security_args(p)
    add_drain_arg(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    config = BrokerConfig(
        **server_fields_from(args),
        handoff_timeout_s=args.handoff_timeout,
        heartbeat_interval_s=args.heartbeat_interval,
        liveness_grace_s=args.liveness_grace,
        terminal_ttl_s=args.terminal_ttl,
    )

    return run_server("kv-broker", serve, config)
