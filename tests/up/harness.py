"""Run ``dsmesh up`` as a real process for the tests: its output, its children, free ports."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from dsmesh.v1 import kv_broker_pb2, kv_broker_pb2_grpc

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


def list_instances(broker: str) -> list[kv_broker_pb2.Instance]:
    with grpc.insecure_channel(broker) as ch:
        try:
            resp = kv_broker_pb2_grpc.KVBrokerStub(ch).ListInstances(
                kv_broker_pb2.ListInstancesRequest(), timeout=2
            )
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
