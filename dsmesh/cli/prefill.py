"""``dsmesh prefill``: run one prefill instance."""

from __future__ import annotations

import argparse

from dsmesh.cli.common import add_instance_args, instance_config_from, run_instance
from dsmesh.prefill_svc.service import PrefillConfig


def configure(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Prefill instance: runs prompts in chunks and writes each chunk's KV "
        "straight into the pages a decode instance reserved, through the transfer engine."
    )
    add_instance_args(p, PrefillConfig)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dsmesh.prefill_svc.service import serve

    config = instance_config_from(PrefillConfig, args, deepep_mode="normal")
    return run_instance("prefill", serve, config)
