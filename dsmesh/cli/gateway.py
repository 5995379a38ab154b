"""``dsmesh gateway``: the public API in front of the prefill/decode instances."""

from __future__ import annotations

import argparse

from dsmesh.cli.common import (
    add_drain_arg,
    add_host_args,
    add_security_args,
    advertise_host_from,
    api_keys_from,
    tls_config_from,
)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "gateway",
        help="serve the public API (gRPC, REST, OpenAI) and route to prefill/decode or unified",
        description="Gateway: gRPC dsmesh.v1.Generation, REST transcoded from its "
        "google.api.http annotations, OpenAI-compatible routes, /health and /metrics. "
        "Prefill, decode and unified instances are discovered through kv_broker. Requests "
        "wait in a FIFO queue until an instance has room for them (docs/GATEWAY.md).",
    )
    p.add_argument("--broker", required=True, help="kv_broker address HOST:PORT")
    p.add_argument("--model", default=None, help="checkpoint folder (tokenizer, chat template)")
    add_host_args(p)
    p.add_argument("--grpc-port", type=int, default=50051, help="gRPC port (0 = any free port)")
    p.add_argument("--http-port", type=int, default=8000, help="HTTP port (0 = any free port)")
    p.add_argument(
        "--served-model-name",
        action="append",
        default=[],
        metavar="NAME",
        help="model id in the OpenAI routes; repeat it or give a comma list for aliases, any "
        "of which a request may use (default: the model folder's name)",
    )
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument(
        "--handoff-timeout", type=float, default=30.0, help="seconds to wait for the prompt's KV"
    )
    p.add_argument("--max-body-bytes", type=int, default=8 << 20, help="largest accepted HTTP body")
    p.add_argument(
        "--max-inflight",
        type=int,
        default=512,
        help="requests dispatched to instances at most; more wait in the queue (default 512)",
    )
    p.add_argument(
        "--max-queued",
        type=int,
        default=1024,
        help="requests waiting in the gateway's queue at most; beyond it clients get 429 / "
        "RESOURCE_EXHAUSTED (default 1024; 0: no queue)",
    )
    p.add_argument(
        "--kv-routing-weight",
        type=float,
        default=1.0,
        metavar="W",
        help="KV-aware routing: what one prompt token cached on an instance weighs against "
        "one token of load (queued prefill tokens, free KV tokens); 0: route by load alone "
        "(default 1.0, docs/GATEWAY.md)",
    )
    p.add_argument(
        "--reasoning-parser",
        default="",
        metavar="NAME",
        help="split a reasoning model's output in chat completions: deepseek-r1 puts "
        "<think>...</think> in reasoning_content (default: off, docs/GATEWAY.md)",
    )
    add_security_args(p, api_keys=True)
    add_drain_arg(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dsmesh.engine.options import resolve_model_dir
    from dsmesh.gateway.openai_api import served_model_names
    from dsmesh.gateway.service import GatewayConfig, serve
    from dsmesh.runtime.address import host_port
    from dsmesh.runtime.grpc_server import run_until_signal

    config = GatewayConfig(
        broker_address=args.broker,
        model_dir=str(resolve_model_dir(args.model)),
        host=args.host,
        advertise_host=advertise_host_from(args),
        grpc_port=args.grpc_port,
        http_port=args.http_port,
        served_model_names=served_model_names(args.served_model_name),
        request_timeout_s=args.request_timeout,
        handoff_timeout_s=args.handoff_timeout,
        max_body_bytes=args.max_body_bytes,
        max_inflight=args.max_inflight,
        max_queued=args.max_queued,
        kv_routing_weight=args.kv_routing_weight,
        tls=tls_config_from(args),
        max_message_bytes=args.max_message_bytes,
        drain_timeout_s=args.drain_timeout,
        api_keys=api_keys_from(args),
        reasoning_parser=args.reasoning_parser,
    )

    def ready(grpc_port: int, http_port: int) -> None:
        print(f"gateway listening on {host_port(config.advertise_host, grpc_port)}", flush=True)
        print(
            f"gateway http listening on {host_port(config.advertise_host, http_port)}", flush=True
        )

    run_until_signal(lambda stop: serve(config, stop, ready))
    return 0
