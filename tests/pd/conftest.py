"""A real PD mesh for the tests: kv_broker, prefill and decode as separate processes on
loopback, two page sizes, sharing one broker and the tiny default model."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from dsmesh.runtime.launcher import ServiceProcess, dsmesh_command, start_service
from tests.mesh import free_port


@dataclass
class Mesh:
    broker: ServiceProcess
    prefill: dict[int, ServiceProcess]  # page size -> instance
    decode: dict[int, ServiceProcess]
    cache_dir: Path
    log_dir: Path
    metrics_ports: dict[str, int]  # "prefill"/"decode" (page size 16) -> /metrics port


@pytest.fixture(scope="session")
def mesh(tmp_path_factory: pytest.TempPathFactory):
    cache = tmp_path_factory.mktemp("cache")
    logs = tmp_path_factory.mktemp("logs")
    env = {"DSMESH_CACHE_DIR": str(cache)}
    # Build the default model once, before several processes race for it.
    os.environ["DSMESH_CACHE_DIR"] = str(cache)
    from dsmesh.engine.model.tiny_model import default_model_dir

    default_model_dir()
    broker = start_service(
        "kv-broker",
        dsmesh_command("kv-broker", "--port", "0", "--liveness-grace", "1"),
        env=env,
        log_dir=logs,
    )
    specs = {}
    metrics_ports = {"prefill": free_port(), "decode": free_port()}
    for page_size in (1, 16):
        common = ["--broker", broker.address, "--page-size", str(page_size)]
        extra = {"prefill": [], "decode": []}
        if page_size == 16:
            extra = {role: ["--metrics-port", str(port)] for role, port in metrics_ports.items()}
        specs[("prefill", page_size)] = dsmesh_command(
            "prefill",
            *common,
            "--max-batch-tokens",
            "96",
            "--max-total-tokens",
            "32768",
            *extra["prefill"],
        )
        specs[("decode", page_size)] = dsmesh_command(
            "decode",
            *common,
            "--max-total-tokens",
            "32768",
            "--handoff-timeout",
            "20",
            "--release-quarantine",
            "5",
            "--reserve-wait",
            "2",
            *extra["decode"],
        )
    started: list[ServiceProcess] = [broker]
    try:
        with ThreadPoolExecutor(len(specs)) as pool:
            futures = {
                key: pool.submit(start_service, f"{key[0]}-{key[1]}", args, env, logs)
                for key, args in specs.items()
            }
            procs = {key: f.result() for key, f in futures.items()}
        started += list(procs.values())
        yield Mesh(
            broker,
            {ps: procs[("prefill", ps)] for ps in (1, 16)},
            {ps: procs[("decode", ps)] for ps in (1, 16)},
            cache,
            logs,
            metrics_ports,
        )
    finally:
        for proc in reversed(started):
            proc.stop()
