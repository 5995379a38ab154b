"""A small mesh behind a gateway on free ports, as separate processes on loopback with the tiny
default model in float32: either PD (one prefill, one decode) or one unified instance. Prompt
chunks of 16 tokens, so a prompt of a few dozen tokens takes several forwards."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from dsmesh.runtime.launcher import ServiceProcess, dsmesh_command
from tests.mesh import running_gateway_mesh

CHUNK_TOKENS = 16  # --max-batch-tokens of every instance: the prefill chunk


@dataclass
class OutputsMesh:
    kind: str  # "pd" or "unified"
    gateway: ServiceProcess
    http_port: int
    model_dir: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def grpc_address(self) -> str:
        return self.gateway.address


@contextmanager
def running_outputs_mesh(
    kind: str, cache: Path, logs: Path, gateway_args: tuple[str, ...] = ()
) -> Iterator[OutputsMesh]:
    def instances(broker: str) -> dict[str, list[str]]:
        common = ("--broker", broker, "--dtype", "float32", "--max-batch-tokens", str(CHUNK_TOKENS))
        roles = ("prefill", "decode") if kind == "pd" else ("unified",)
        return {role: dsmesh_command(role, *common) for role in roles}

    with running_gateway_mesh(cache, logs, instances, gateway_args) as (procs, port, model):
        yield OutputsMesh(kind, procs["gateway"], port, model)
