"""Helpers that start mesh processes for the multi-process tests."""

from __future__ import annotations

from pathlib import Path

from dsmesh.launcher import ServiceProcess, dsmesh_command, start_service


def start_gateway(broker: str, model: str, env: dict[str, str], log_dir: Path) -> ServiceProcess:
    """A gateway on free gRPC and HTTP ports, finding the mesh through ``broker``."""
    args = dsmesh_command(
        "gateway", "--broker", broker, "--model", model, "--grpc-port", "0", "--http-port", "0"
    )
    return start_service("gateway", args, env=env, log_dir=log_dir)
