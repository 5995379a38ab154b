"""``dsmesh kv-broker``: run the KV handoff broker (prefill/decode rendezvous and liveness)."""

from __future__ import annotations

import argparse

from dsmesh.cli.server_flags import run_server, server_config_from
from dsmesh.kv_broker.config import BrokerConfig
from dsmesh.options.fields import add_options


def configure(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Serve dsmesh.v1.KVBroker: the per-request handoff state machine (RESERVED -> "
        "TRANSFERRING -> DONE/FAILED/ABORTED/TIMED_OUT) and the liveness of attached "
        "prefill/decode instances. Prints 'kv-broker listening on HOST:PORT' once ready; "
        "SIGTERM/SIGINT stop it gracefully."
    )
    add_options(p, BrokerConfig)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dsmesh.kv_broker.service import serve

    return run_server("kv-broker", serve, server_config_from(BrokerConfig, args))
