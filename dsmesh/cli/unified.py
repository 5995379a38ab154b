"""``dsmesh unified``: run one unified instance (prefill and decode in one engine)."""

from __future__ import annotations

import argparse

from dsmesh.cli.common import add_instance_args, instance_config_from, run_instance
from dsmesh.unified_svc.service import UnifiedConfig


def configure(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Unified instance: takes whole requests from the gateway, prefills them "
        "in chunks mixed into the decode batches and streams the tokens; the single-GPU mode, "
        "and the baseline PD disaggregation must beat. Attaches to kv_broker for discovery "
        "and liveness only."
    )
    add_instance_args(p, UnifiedConfig)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dsmesh.unified_svc.service import serve

    return run_instance("unified", serve, instance_config_from(UnifiedConfig, args))
