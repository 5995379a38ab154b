"""``dsmesh unified``: run one unified instance (prefill and decode in one engine)."""

from __future__ import annotations

import argparse

from dsmesh.cli.common import (
    add_engine_args,
    add_security_args,
    add_server_args,
    engine_config_from,
    server_fields_from,
)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "unified",
        help="run a unified instance (prefill and decode in one engine, no KV handoff)",
        description="Unified instance: takes whole requests from the gateway, prefills them "
        "in chunks mixed into the decode batches and streams the tokens; the single-GPU mode, "
        "and the baseline PD disaggregation must beat. Attaches to kv_broker for discovery "
        "and liveness only.",
    )
    add_server_args(p)
    p.add_argument("--broker", required=True, help="kv_broker address HOST:PORT")
    add_security_args(p)
    add_engine_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dsmesh.runtime.address import host_port
    from dsmesh.runtime.grpc_server import run_until_signal
    from dsmesh.unified_svc.service import UnifiedConfig, serve

    config = UnifiedConfig(
        **server_fields_from(args),
        broker_address=args.broker,
        engine=engine_config_from(args),
        instance_id=args.instance_id,
    )

    def ready(instance_id: str, port: int) -> None:
        print(
            f"unified {instance_id} listening on {host_port(config.advertise_host, port)}",
            flush=True,
        )

    run_until_signal(lambda stop: serve(config, stop, ready))
    return 0
