"""A small mesh behind a gateway on free ports, as separate processes on loopback with the tiny
default model in float32: either PD (one prefill, one decode) or one unified instance. Prompt
chunks of 16 tokens, so a prompt of a few dozen tokens takes several forwards."""

from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from dsmesh.cli.launcher import ServiceProcess, dsmesh_command, start_service
from tests.reliability.soak_harness import wait_http_ok
from tests.up.harness import free_port

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
    env = {"DSMESH_CACHE_DIR": str(cache)}
    os.environ["DSMESH_CACHE_DIR"] = str(cache)
    from engine.tiny_model import default_model_dir

    model = default_model_dir()  # built once here, before the children race for it
    started: list[ServiceProcess] = []
    try:
        broker = start_service(
            "kv-broker", dsmesh_command("kv-broker", "--port", "0"), env=env, log_dir=logs
        )
        started.append(broker)
        http_port = free_port()
        common = ("--broker", broker.address, "--dtype", "float32")
        common += ("--max-batch-tokens", str(CHUNK_TOKENS))
        roles = ("prefill", "decode") if kind == "pd" else ("unified",)
        specs = {role: dsmesh_command(role, *common) for role in roles}
        specs["gateway"] = dsmesh_command(
            "gateway",
            *("--broker", broker.address, "--model", str(model)),
            *("--grpc-port", "0", "--http-port", str(http_port), *gateway_args),
        )
        with ThreadPoolExecutor(len(specs)) as pool:
            futures = {
                name: pool.submit(start_service, name, args, env, logs)
                for name, args in specs.items()
            }
            procs = {name: future.result() for name, future in futures.items()}
        started += procs.values()
        mesh = OutputsMesh(kind, procs["gateway"], http_port, model)
        wait_http_ok(f"{mesh.url}/health", 60)
        yield mesh
    finally:
        for proc in reversed(started):
            proc.stop()
