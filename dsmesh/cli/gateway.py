"""``dsmesh gateway``: the public API in front of the prefill/decode instances."""

from __future__ import annotations

import argparse

from dsmesh.cli.server_flags import server_config_from
from dsmesh.gateway.config import GatewayConfig
from dsmesh.options.fields import add_options


def configure(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Gateway: gRPC dsmesh.v1.Generation, REST transcoded from its "
        "google.api.http annotations, OpenAI-compatible routes, /health and /metrics. "
        "Prefill, decode and unified instances are discovered through kv_broker. Requests "
        "wait in a FIFO queue until an instance has room for them (docs/GATEWAY.md)."
    )
    add_options(p, GatewayConfig)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dsmesh.gateway.openai_api import served_model_names
    from dsmesh.gateway.service import serve
    from dsmesh.runtime.address import host_port
    from dsmesh.runtime.grpc_server import run_until_signal

    if args.model is not None:
        model_dir = args.model
    else:  # the tiny built-in model, built with torch on first use
        from dsmesh.engine.options import resolve_model_dir

        model_dir = str(resolve_model_dir(None))
    config = server_config_from(
        GatewayConfig,
        args,
        model_dir=model_dir,
        served_model_names=served_model_names(args.served_model_name or ()),
    )

    def ready(grpc_port: int, http_port: int) -> None:
        print(f"gateway listening on {host_port(config.advertise_host, grpc_port)}", flush=True)
        print(
            f"gateway http listening on {host_port(config.advertise_host, http_port)}", flush=True
        )

    run_until_signal(lambda stop: serve(config, stop, ready))
    return 0
