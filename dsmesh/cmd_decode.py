"""``dsmesh decode``: run one decode instance."""

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
        "decode",
        help="run a decode instance (page pre-allocation, continuous batching, streaming)",
        description="Decode instance: admits a request only if KV pages are free, reserves "
        "them, waits for prefill to write the prompt's KV, then decodes and streams tokens.",
    )
    add_server_args(p)
    add_transfer_args(p)
    p.add_argument(
        "--handoff-timeout",
        type=float,
        default=30.0,
        help="seconds a request may wait for its prompt KV (default 30)",
    )
    p.add_argument(
        "--release-quarantine",
        type=float,
        default=10.0,
        help="longest wait for prefill to release a failed handoff before its pages are reused",
    )
    add_security_args(p)
    add_ep_args(p)
    add_engine_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from decode_svc.service import DecodeConfig, serve
    from dsmesh.grpc_server import run_until_signal

    config = DecodeConfig(
        broker_address=args.broker,
        engine=engine_config_from(args),
        transfer=transfer_config_from(args),
        host=args.host,
        port=args.port,
        instance_id=args.instance_id,
        metrics_port=args.metrics_port,
        tls=tls_config_from(args),
        max_message_bytes=args.max_message_bytes,
        handoff_timeout_s=args.handoff_timeout,
        release_quarantine_s=args.release_quarantine,
    )

    def ready(instance_id: str, port: int) -> None:
        print(f"decode {instance_id} listening on {args.host}:{port}", flush=True)

    ep = ep_config_from(args, deepep_mode="low_latency")  # decode steps are small
    if ep.ep_size > 1 or ep.num_redundant_experts:
        from dsmesh.ep_group import RankTarget, run_group
        from dsmesh.instance import new_instance_id

        base_id = config.instance_id or new_instance_id("decode")
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
