"""``dsmesh decode``: run one decode instance."""

from __future__ import annotations

import argparse

from dsmesh.cli.common import add_instance_args, instance_config_from, run_instance
from dsmesh.decode_svc.service import DecodeConfig


def configure(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Decode instance: admits a request only if KV pages are free, reserves "
        "them, waits for prefill to write the prompt's KV, then decodes and streams tokens."
    )
    add_instance_args(p, DecodeConfig)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dsmesh.decode_svc.service import serve

    config = instance_config_from(DecodeConfig, args, deepep_mode="low_latency")
    return run_instance("decode", serve, config)
