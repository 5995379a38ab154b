"""Start a small mesh for gateway tests: kv_broker, the instances a test names and a
gateway on free ports, as separate processes on loopback with the tiny default model."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

from dsmesh.runtime.launcher import ServiceProcess, dsmesh_command, start_service
from tests.reliability.soak_harness import wait_http_ok
from tests.up.harness import free_port

Instances = Callable[[str], dict[str, list[str]]]  # broker address -> name -> command


@contextmanager
def running_gateway_mesh(
    cache: Path | None,
    logs: Path,
    instances: Instances,
    gateway_args: tuple[str, ...] = (),
    model: Path | None = None,
) -> Iterator[tuple[dict[str, ServiceProcess], int, Path]]:
    """Yields (every process by name, the gateway's as "gateway"; the gateway's HTTP port;
    the model folder) once the gateway is healthy; stops every process on exit. ``model``
    None: the tiny default model, built in ``cache`` (DSMESH_CACHE_DIR of every process)."""
    env: dict[str, str] = {}
    if model is None:
        assert cache is not None, "the default model is built in a cache folder"
        env = {"DSMESH_CACHE_DIR": str(cache)}
        os.environ["DSMESH_CACHE_DIR"] = str(cache)
        from dsmesh.engine.model.tiny_model import default_model_dir

        model = default_model_dir()  # built once here, before the children race for it
    started: list[ServiceProcess] = []
    try:
        broker = start_service(
            "kv-broker", dsmesh_command("kv-broker", "--port", "0"), env=env, log_dir=logs
        )
        started.append(broker)
        http_port = free_port()
        specs = instances(broker.address)
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
        wait_http_ok(f"http://127.0.0.1:{http_port}/health", 120)
        yield procs, http_port, model
    finally:
        for proc in reversed(started):
            proc.stop()


def one_unified(model: Path, *args: str) -> Instances:
    """One unified instance of ``model`` in float32 (more flags in ``args``)."""

    def instances(broker: str) -> dict[str, list[str]]:
        flags = ("--broker", broker, "--model", str(model), "--dtype", "float32", *args)
        return {"unified": dsmesh_command("unified", *flags)}

    return instances
