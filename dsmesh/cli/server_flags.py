"""What every server command shares, kept free of torch and the engine (the broker, eplb and
gateway commands import only this): a server's config from its parsed flags, with the
advertised host and TLS resolved, and serving it until a signal."""

from __future__ import annotations

import argparse
from typing import TypeVar

from dsmesh.options.fields import from_args
from dsmesh.runtime.address import advertise_host, host_port
from dsmesh.runtime.security import TLSConfig

Config = TypeVar("Config")


def tls_config_from(args: argparse.Namespace) -> TLSConfig:
    return TLSConfig.from_env_and_args(args)


def advertise_host_from(args: argparse.Namespace) -> str:
    """The host this process's peers dial (``--advertise-host``, else from ``--host``)."""
    return advertise_host(args.host, args.advertise_host)


def server_config_from(cls: type[Config], args: argparse.Namespace, **fixed) -> Config:
    """A server's config (a :class:`~dsmesh.runtime.server_options.ServerOptions`) from
    its parsed flags, with the advertised host resolved and TLS from flags and environment."""
    return from_args(
        cls, args, advertise_host=advertise_host_from(args), tls=tls_config_from(args), **fixed
    )


def run_server(label: str, serve, config) -> int:
    """Serve ``config`` until SIGTERM/SIGINT, printing ``<label> listening on HOST:PORT``
    once ready (what ``dsmesh up`` and the launchers wait for)."""
    from dsmesh.runtime.grpc_server import run_until_signal

    def ready(port: int) -> None:
        print(f"{label} listening on {host_port(config.advertise_host, port)}", flush=True)

    run_until_signal(lambda stop: serve(config, stop, ready))
    return 0
