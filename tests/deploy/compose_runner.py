"""Run compose.yaml's default services on loopback the way ``docker compose up`` would.

Each service runs its image's entry point (``dsmesh``) with the service's ``command`` and
``environment`` (interpolated as compose does), in ``depends_on`` order; a dependency with
``condition: service_healthy`` is waited for by running its ``healthcheck.test``. Only what
containers would give each service differs: every service name (its own address on the
compose network) becomes 127.0.0.1, ``0.0.0.0`` becomes 127.0.0.1, and every port becomes a
free port (a block of consecutive free ports for the ranks of an expert-parallel instance),
consistently in commands, environment and healthchecks.
"""

from __future__ import annotations

import contextlib
import io
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsmesh.cli import healthcheck

LOOPBACK = "127.0.0.1"
PORT_FLAGS = ("--port", "--grpc-port", "--http-port", "--metrics-port", "--ep-master-port")
RANKED_PORT_FLAGS = ("--port", "--metrics-port")  # rank r uses PORT + r
HOST_FLAGS = ("--host", "--transfer-hostname", "--ep-master-addr")


def _flag(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv else None


def ranks_per_node(argv: list[str]) -> int:
    ep_size = int(_flag(argv, "--ep-size") or 1)
    return ep_size // int(_flag(argv, "--ep-nnodes") or 1)


def _ephemeral_start() -> int:
    """First port of the kernel's ephemeral range (outgoing connections, gloo's pairs)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _free_block(width: int, taken: set[int]) -> int:
    """First port of ``width`` consecutive ports that are free now and not handed out.

    Drawn below the ephemeral range: a port the kernel hands out for port 0 can be taken by
    any outgoing connection (the EP ranks' gloo pairs, say) before the service binds it."""
    top = max(min(_ephemeral_start(), 32768), 20000) - width
    for _ in range(200):
        base = random.randrange(10000, top)
        ports = range(base, base + width)
        if taken.intersection(ports):
            continue
        try:
            with contextlib.ExitStack() as stack:
                for port in ports:
                    sock = stack.enter_context(socket.socket())
                    sock.bind((LOOPBACK, port))
        except OSError:
            continue
        return base
    raise RuntimeError(f"no {width} consecutive free ports")


def port_map(services: dict[str, dict[str, Any]]) -> dict[int, int]:
    """Every port a service serves on -> a free port (blocks for EP ranks)."""
    mapping: dict[int, int] = {}
    for svc in services.values():
        argv = svc["command"]
        for flag in PORT_FLAGS:
            value = _flag(argv, flag)
            if value is None or int(value) in mapping or int(value) == 0:
                continue
            width = ranks_per_node(argv) if flag in RANKED_PORT_FLAGS else 1
            base = _free_block(width, set(mapping.values()))
            for r in range(width):
                mapping[int(value) + r] = base + r
    return mapping


@dataclass
class Rewriter:
    names: set[str]
    ports: dict[int, int]

    def address(self, text: str) -> str:
        """``[scheme://]NAME[:PORT][/path]`` with NAME a service -> loopback, mapped port."""
        pattern = rf"^(https?://)?({'|'.join(map(re.escape, self.names))}|0\.0\.0\.0)(:\d+)?(/.*)?$"
        m = re.match(pattern, text)
        if not m:
            return text
        port = f":{self.ports.get(int(m.group(3)[1:]), m.group(3)[1:])}" if m.group(3) else ""
        return f"{m.group(1) or ''}{LOOPBACK}{port}{m.group(4) or ''}"

    def argv(self, argv: list[str]) -> list[str]:
        out = list(argv)
        for i in range(1, len(out)):
            prev = out[i - 1]
            if prev in PORT_FLAGS and int(out[i]) in self.ports:
                out[i] = str(self.ports[int(out[i])])
            elif prev in HOST_FLAGS or not out[i].startswith("-"):
                out[i] = self.address(out[i])
        return out


@dataclass
class Service:
    name: str
    argv: list[str]
    env: dict[str, str]
    healthcheck: list[str] | None
    process: subprocess.Popen[bytes]
    log_path: Path


@dataclass
class Mesh:
    services: dict[str, Service] = field(default_factory=dict)
    ports: dict[int, int] = field(default_factory=dict)

    def log_tail(self, lines: int = 40) -> str:
        out = []
        for s in self.services.values():
            text = s.log_path.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"----- {s.name} (exit {s.process.poll()}): {' '.join(s.argv)}")
            out += text
        return "\n".join(out)


def run_healthcheck(test: list[str]) -> bool:
    """A compose ``healthcheck.test``; ``python -m dsmesh.cli.healthcheck`` runs in-process (the
    same code as the module's entry point, without a Python start-up per probe)."""
    if test[0] != "CMD":
        raise ValueError(f"healthcheck {test}: only the exec form [CMD, ...] is modelled")
    command = test[1:]
    if command[:3] == ["python", "-m", "dsmesh.cli.healthcheck"]:
        with contextlib.redirect_stderr(io.StringIO()):
            return healthcheck.main(command[3:]) == 0
    command = [sys.executable if c == "python" else c for c in command]
    return subprocess.run(command, capture_output=True, timeout=30).returncode == 0


def start_order(services: dict[str, dict[str, Any]]) -> list[str]:
    order: list[str] = []

    def visit(name: str, path: tuple[str, ...]) -> None:
        if name in order:
            return
        if name in path:
            raise ValueError(f"depends_on cycle: {' -> '.join((*path, name))}")
        for dep in services[name].get("depends_on", {}):
            visit(dep, (*path, name))
        order.append(name)

    for name in services:
        visit(name, ())
    return order


def wait_healthy(mesh: Mesh, name: str, timeout: float) -> None:
    service = mesh.services[name]
    if service.healthcheck is None:
        return
    deadline = time.monotonic() + timeout
    while not run_healthcheck(service.healthcheck):
        if service.process.poll() is not None:
            raise AssertionError(
                f"{name} exited with {service.process.returncode}\n{mesh.log_tail()}"
            )
        if time.monotonic() > deadline:
            raise AssertionError(f"{name} not healthy within {timeout:.0f}s\n{mesh.log_tail()}")
        time.sleep(0.25)


@contextlib.contextmanager
def compose_up(
    compose: dict[str, Any], log_dir: Path, env: dict[str, str], timeout: float = 150.0
) -> Iterator[Mesh]:
    """The default services (those without ``profiles``) of an interpolated compose file,
    started in dependency order, each healthy before what depends on it starts; all stopped
    (SIGTERM, then SIGKILL of the process group) on exit."""
    services = {n: s for n, s in compose["services"].items() if not s.get("profiles")}
    mesh = Mesh(ports=port_map(services))
    rewrite = Rewriter(set(services), mesh.ports)
    deadline = time.monotonic() + timeout
    try:
        for name in start_order(services):
            svc = services[name]
            for dep, cond in svc.get("depends_on", {}).items():
                if cond.get("condition", "service_started") == "service_healthy":
                    wait_healthy(mesh, dep, deadline - time.monotonic())
            argv = rewrite.argv([str(a) for a in svc["command"]])
            service_env = {
                k: rewrite.address(str(v)) for k, v in svc.get("environment", {}).items()
            }
            test = svc.get("healthcheck", {}).get("test")
            log_path = log_dir / f"{name}.log"
            with open(log_path, "wb") as log:
                process = subprocess.Popen(
                    [sys.executable, "-m", "dsmesh", *argv],  # the image's ENTRYPOINT + command
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env={**os.environ, **env, **service_env},
                    start_new_session=True,
                )
            mesh.services[name] = Service(
                name, argv, service_env, rewrite.argv(test) if test else None, process, log_path
            )
        for name in mesh.services:  # `docker compose up --wait`
            wait_healthy(mesh, name, deadline - time.monotonic())
        yield mesh
    finally:
        for service in reversed(list(mesh.services.values())):
            if service.process.poll() is None:
                service.process.send_signal(signal.SIGTERM)
        for service in reversed(list(mesh.services.values())):
            with contextlib.suppress(subprocess.TimeoutExpired):
                service.process.wait(15)
            with contextlib.suppress(ProcessLookupError):  # EP rank processes left behind
                os.killpg(service.process.pid, signal.SIGKILL)
            service.process.wait(5)
