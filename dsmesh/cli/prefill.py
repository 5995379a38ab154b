"""``dsmesh prefill``: run one prefill instance."""

from __future__ import annotations

import argparse

from dsmesh.cli.common import add_instance_args, instance_fields_from, run_instance
from dsmesh.runtime import argtypes


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "prefill",
        help="run a prefill instance (chunked prefill, KV pushed into decode's pages)",
        description="Prefill instance: runs prompts in chunks and writes each chunk's KV "
        "straight into the pages a decode instance reserved, through the transfer engine.",
    )
    p.add_argument(
        "--resolve-wait",
        type=argtypes.seconds,
        default=30.0,
        help="seconds to wait for decode's page reservation (default 30)",
    )
    p.add_argument(
        "--max-queued-tokens",
        type=argtypes.count,
        default=262144,
        help="prompt tokens admitted and unfinished at most; beyond it RESOURCE_EXHAUSTED",
    )
    p.add_argument(
        "--max-transfer-backlog",
        type=argtypes.seconds,
        default=1.0,
        help="new prompts wait while the queued KV writes would take longer than this many "
        "seconds at the measured transfer rate (default 1)",
    )
    add_instance_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dsmesh.prefill_svc.service import PrefillConfig, serve

    config = PrefillConfig(
        **instance_fields_from(args),
        resolve_wait_s=args.resolve_wait,
        max_queued_tokens=args.max_queued_tokens,
        max_transfer_backlog_s=args.max_transfer_backlog,
    )
    return run_instance("prefill", serve, config, args, deepep_mode="normal")
