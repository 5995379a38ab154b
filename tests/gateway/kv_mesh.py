"""A mesh of unified instances with their prefix caches on (the default), behind a gateway,
as separate processes on loopback with the tiny default model in float32: for KV-aware
routing and the cached-token figures of ``dsmesh bench``."""

from __future__ import annotations

import re
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from dsmesh.runtime.launcher import ServiceProcess, dsmesh_command
from tests.mesh import free_port, running_gateway_mesh

PAGE_SIZE = 16


@dataclass
class KVMesh:
    gateway: ServiceProcess
    http_port: int
    metrics_ports: list[int]  # of each unified instance, in start order
    model_dir: Path
    unified_addresses: list[str]  # gRPC address of each unified instance, in start order

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def grpc_address(self) -> str:
        return self.gateway.address


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        return resp.read().decode()


def metric(text: str, name: str, labels: str = "") -> float:
    """The value of ``name{labels}`` in Prometheus text (0 when absent)."""
    pattern = rf"^{re.escape(name)}{re.escape('{' + labels + '}') if labels else ''} (\S+)$"
    m = re.search(pattern, text, re.M)
    return float(m.group(1)) if m else 0.0


@contextmanager
def running_kv_mesh(
    num_unified: int,
    cache: Path,
    logs: Path,
    unified_args: tuple[str, ...] = (),
    gateway_args: tuple[str, ...] = (),
) -> Iterator[KVMesh]:
    metrics_ports = [free_port() for _ in range(num_unified)]

    def instances(broker: str) -> dict[str, list[str]]:
        return {
            f"unified-{i}": dsmesh_command(
                "unified",
                *("--broker", broker, "--dtype", "float32"),
                *("--instance-id", f"unified-{i}", "--page-size", str(PAGE_SIZE)),
                *("--metrics-port", str(port), *unified_args),
            )
            for i, port in enumerate(metrics_ports)
        }

    with running_gateway_mesh(cache, logs, instances, gateway_args) as (procs, port, model):
        unified = [procs[f"unified-{i}"].address for i in range(num_unified)]
        yield KVMesh(procs["gateway"], port, metrics_ports, model, unified)
