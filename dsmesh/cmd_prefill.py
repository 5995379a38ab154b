"""``dsmesh prefill``: run one prefill instance."""

from __future__ import annotations

import argparse
import dataclasses

from dsmesh.cli_common import (
    add_engine_args,
    add_ep_args,
    add_security_args,
    add_server_args,
    add_transfer_args,
    engine_config_from,
    ep_config_from,
    tls_config_from,
    transfer_config_from,
)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "prefill",
        help="run a prefill instance (chunked prefill, KV pushed into decode's pages)",
        description="Prefill instance: runs prompts in chunks and writes each chunk's KV "
        "straight into the pages a decode instance reserved, through the transfer engine.",
    )
    add_server_args(p)
    add_transfer_args(p)
    p.add_argument(
        "--resolve-wait",
        type=float,
        default=30.0,
        help="seconds to wait for decode's page reservation (default 30)",
    )
    p.add_argument(
        "--max-queued-tokens",
        type=int,
        default=262144,
        help="prompt tokens admitted and unfinished at most; beyond it RESOURCE_EXHAUSTED",
    )
    add_security_args(p)
    add_ep_args(p)
    add_engine_args(p, prefix_cache_default=True)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dsmesh.grpc_server import run_until_signal
    from prefill_svc.service import PrefillConfig, serve

    config = PrefillConfig(
        broker_address=args.broker,
        engine=engine_config_from(args),
        transfer=transfer_config_from(args),
        host=args.host,
        port=args.port,
        instance_id=args.instance_id,
        metrics_port=args.metrics_port,
        tls=tls_config_from(args),
        max_message_bytes=args.max_message_bytes,
        resolve_wait_s=args.resolve_wait,
        max_queued_tokens=args.max_queued_tokens,
    )

    def ready(instance_id: str, port: int) -> None:
        print(f"prefill {instance_id} listening on {args.host}:{port}", flush=True)

    ep = ep_config_from(args)
    if ep.ep_size > 1 or ep.num_redundant_experts:
        from dsmesh.ep_group import RankTarget, run_group
        from dsmesh.instance import new_instance_id

        base_id = config.instance_id or new_instance_id("prefill")
        config = dataclasses.replace(config, instance_id=base_id)
        return run_group(
            ep,
            RankTarget(serve, config),
            ready,
            eplb_address=args.eplb,
            eplb_report_interval_s=args.eplb_report_interval,
        )
    if args.eplb:
        raise ValueError("--eplb needs an expert-parallel instance: --ep-size > 1")
    run_until_signal(lambda stop: serve(config, stop, ready))
    return 0
