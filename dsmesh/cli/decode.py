"""``dsmesh decode``: run one decode instance."""

from __future__ import annotations

import argparse

from dsmesh.cli.common import add_instance_args, instance_fields_from, run_instance
from dsmesh.runtime import argtypes


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "decode",
        help="run a decode instance (page pre-allocation, continuous batching, streaming)",
        description="Decode instance: admits a request only if KV pages are free, reserves "
        "them, waits for prefill to write the prompt's KV, then decodes and streams tokens.",
    )
    p.add_argument(
        "--handoff-timeout",
        type=argtypes.seconds,
        default=30.0,
        help="seconds a request may wait for its prompt KV (default 30)",
    )
    p.add_argument(
        "--reserve-wait",
        type=argtypes.seconds,
        default=10.0,
        help="seconds a request may wait, in arrival order, for KV pages and a running slot "
        "before RESOURCE_EXHAUSTED (default 10)",
    )
    p.add_argument(
        "--release-quarantine",
        type=argtypes.seconds,
        default=10.0,
        help="longest wait for prefill to release a failed handoff before its pages are reused",
    )
    add_instance_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dsmesh.decode_svc.service import DecodeConfig, serve

    config = DecodeConfig(
        **instance_fields_from(args),
        handoff_timeout_s=args.handoff_timeout,
        release_quarantine_s=args.release_quarantine,
        reserve_wait_s=args.reserve_wait,
    )
    return run_instance("decode", serve, config, args, deepep_mode="low_latency")
