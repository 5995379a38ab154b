"""Starting meshes and services for the tests, in one place: free ports, ``dsmesh up`` as a
process (:class:`UpProcess`), a gateway mesh of separate service processes
(:func:`running_gateway_mesh`), single services (:func:`start_gateway`), and the waits on them
(health, kv_broker's listing, KV pages back in their pools).

The fixtures of tests/*/conftest.py and the fault, soak and KV-routing meshes are built from
these; each waits for the real condition (a health check, a ready line, a listing), never a
fixed sleep.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from dsmesh.runtime.grpc_server import channel
from dsmesh.runtime.launcher import ServiceProcess, dsmesh_command, start_service
from dsmesh.v1 import decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from dsmesh.v1 import kv_broker_pb2 as kb
from dsmesh.v1 import kv_broker_pb2_grpc as kb_grpc

READY_LINE = re.compile(r"^\s+(\S+)\s+ready at (\S+):(\d+)\s+pid (\d+)", re.MULTILINE)


def free_port() -> int:
    """A port nothing listens on right now (the kernel's pick for port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def child_pids(pid: int) -> set[int]:
    """Live (non-zombie) processes whose parent is ``pid``."""
    children = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            children.add(int(entry.name))
    return children


def pid_alive(pid: int) -> bool:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return fields[0] != "Z"


def wait_until(predicate, timeout: float, interval: float = 0.2):
    """``predicate()``'s first truthy value within ``timeout`` seconds, else None."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value or None
        time.sleep(interval)


def grpc_serving(address: str) -> bool:
    with grpc.insecure_channel(address) as ch:
        try:
            resp = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=2
            )
        except grpc.RpcError:
            return False
    return resp.status == health_pb2.HealthCheckResponse.SERVING


def list_instances(broker: str) -> list[kb.Instance]:
    with grpc.insecure_channel(broker) as ch:
        try:
            resp = kb_grpc.KVBrokerStub(ch).ListInstances(kb.ListInstancesRequest(), timeout=2)
        except grpc.RpcError:
            return []
    return list(resp.instances)


class UpProcess:
    """``dsmesh up ARGS`` with its merged stdout/stderr collected line by line."""

    def __init__(self, args: list[str], env: dict[str, str], log_level: str = "") -> None:
        level = ["--log-level", log_level] if log_level else []
        self.process = subprocess.Popen(
            [sys.executable, "-m", "dsmesh", *level, "up", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, **env},
        )
        self._lines: list[str] = []
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.seen_pids: set[int] = set()  # every child pid noticed, for the orphan check

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            with self._changed:
                self._lines.append(line)
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    @property
    def output(self) -> str:
        with self._changed:
            return "".join(self._lines)

    def wait_for(self, pattern: str, timeout: float) -> re.Match[str]:
        """The first match of ``pattern`` in the output; fails after ``timeout`` seconds."""
        regex = re.compile(pattern, re.MULTILINE)
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                match = regex.search("".join(self._lines))
                if match:
                    return match
                remaining = deadline - time.monotonic()
                if remaining <= 0 or (
                    self.process.poll() is not None and not self._reader.is_alive()
                ):
                    raise AssertionError(
                        f"no {pattern!r} within {timeout}s; output:\n{''.join(self._lines)}"
                    )
                self._changed.wait(min(remaining, 0.5))

    def ready_services(self) -> dict[str, tuple[str, int]]:
        """Service name -> (address, pid), from the ready lines."""
        services = {}
        for m in READY_LINE.finditer(self.output):
            services[m.group(1)] = (f"{m.group(2)}:{m.group(3)}", int(m.group(4)))
        self.seen_pids |= {pid for _, pid in services.values()}
        return services

    def note_children(self) -> set[int]:
        pids = child_pids(self.process.pid)
        self.seen_pids |= pids
        return pids

    def close(self) -> None:
        """Stop it, however the test went, and kill any child left behind."""
        if self.process.poll() is None:
            self.note_children()
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        for pid in self.seen_pids:
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)


def wait_http_ok(url: str, timeout: float, proc: subprocess.Popen | None = None) -> None:
    """Returns once ``url`` answers 200; fails after ``timeout`` seconds, or as soon as
    ``proc`` (the process that should serve it) exits."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{proc.args} exited with {proc.returncode} before serving")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} not 200 within {timeout}s")
        time.sleep(0.1)


# ---- services as separate processes -------------------------------------------------------------


def start_gateway(broker: str, model: str, env: dict[str, str], log_dir: Path) -> ServiceProcess:
    """A gateway on free gRPC and HTTP ports, finding the mesh through ``broker``."""
    args = dsmesh_command(
        "gateway", "--broker", broker, "--model", model, "--grpc-port", "0", "--http-port", "0"
    )
    return start_service("gateway", args, env=env, log_dir=log_dir)


async def instance_load(inst: kb.Instance) -> prefill_pb2.PrefillLoad | decode_pb2.DecodeLoad:
    """GetLoad of a registered prefill or decode instance (pages free and total, queue)."""
    async with channel(inst.grpc_address) as ch:
        stub = (
            prefill_pb2_grpc.PrefillStub(ch)
            if inst.role == kb.ROLE_PREFILL
            else decode_pb2_grpc.DecodeStub(ch)
        )
        return await stub.GetLoad(prefill_pb2.LoadRequest())


def two_free_ports() -> int:
    """A port p with p + 1 also free (an EP 2 group's ranks serve /metrics on p + rank)."""
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
        return port
    raise RuntimeError("no two consecutive free ports")


async def _instances(broker_address: str) -> dict[int, list[kb.Instance]]:
    async with channel(broker_address) as ch:
        listing = await kb_grpc.KVBrokerStub(ch).ListInstances(kb.ListInstancesRequest())
    by_role: dict[int, list[kb.Instance]] = {}
    for inst in sorted(listing.instances, key=lambda i: i.instance_id):
        by_role.setdefault(inst.role, []).append(inst)
    return by_role


def group_ranks(
    broker_address: str, num_ranks: int = 2, within: float = 30.0
) -> tuple[list[kb.Instance], list[kb.Instance]]:
    """The prefill and the decode group's ranks, in rank order, once kv_broker lists
    ``num_ranks`` of each (a group prints its ports before every rank's Attach is up);
    whatever it lists after ``within`` seconds otherwise."""
    deadline = time.monotonic() + within
    while True:
        by_role = asyncio.run(_instances(broker_address))
        pre, dec = by_role.get(kb.ROLE_PREFILL, []), by_role.get(kb.ROLE_DECODE, [])
        if len(pre) == len(dec) == num_ranks or time.monotonic() > deadline:
            return pre, dec
        time.sleep(0.2)


def wait_pages_free(ranks: list[kb.Instance], within: float) -> bool:
    """Every rank's KV pages back in its pool (no page leaked by a finished request)."""

    async def all_free() -> bool:
        for inst in ranks:
            load = await instance_load(inst)
            if load.free_pages != load.total_pages:
                return False
        return True

    deadline = time.monotonic() + within
    while not asyncio.run(all_free()):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


# ---- a gateway mesh -----------------------------------------------------------------------------

Instances = Callable[[str], dict[str, list[str]]]  # broker address -> name -> command


@contextmanager
def running_gateway_mesh(
    cache: Path | None,
    logs: Path,
    instances: Instances,
    gateway_args: tuple[str, ...] = (),
    model: Path | None = None,
) -> Iterator[tuple[dict[str, ServiceProcess], int, Path]]:
    """Yields (every process by name: kv_broker's as "kv-broker", the gateway's as "gateway",
    the instances' as ``instances`` names them; the gateway's HTTP port; the model folder) once
    the gateway is healthy; stops every process on exit. ``model``
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
        yield {"kv-broker": broker, **procs}, http_port, model
    finally:
        for proc in reversed(started):
            proc.stop()


def one_unified(model: Path, *args: str) -> Instances:
    """One unified instance of ``model`` in float32 (more flags in ``args``)."""

    def instances(broker: str) -> dict[str, list[str]]:
        flags = ("--broker", broker, "--model", str(model), "--dtype", "float32", *args)
        return {"unified": dsmesh_command("unified", *flags)}

    return instances
