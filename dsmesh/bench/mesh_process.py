"""A mesh as a process the serving benchmark starts and stops: ``dsmesh up`` on free loopback
ports until a block ends (its output to a log), and py-spy sampling the Python stacks of the
mesh's engine processes."""

from __future__ import annotations

import contextlib
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsmesh.bench.mesh_metrics import instance_metrics_urls


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_run(count: int) -> int:
    """The first of ``count`` consecutive free loopback ports."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + count > 65535:
            continue
        with contextlib.ExitStack() as stack:
            try:
                for port in range(base, base + count):
                    stack.enter_context(socket.socket()).bind(("127.0.0.1", port))
            except OSError:
                continue
        return base
    raise RuntimeError(f"no {count} consecutive free ports")


@dataclass
class Mesh:
    process: subprocess.Popen[str]
    grpc_addr: str
    metrics_url: str  # the gateway's
    log: Path
    # each engine instance's /metrics URL by name, as its ready summary lists them (with
    # ``--instance-metrics-port``; else empty)
    instance_metrics: dict[str, str] = field(default_factory=dict)


@contextlib.contextmanager
def mesh_up(
    model: str | None,
    up_args: list[str],
    log_dir: Path,
    start_timeout_s: float,
    on_line: Callable[[str], None] | None = None,
) -> Iterator[Mesh]:
    """``dsmesh up`` on free ports until the block ends (SIGINT, then SIGKILL). ``model``
    None: the tiny default model. ``on_line`` sees each line of its output as it arrives
    (on the reading thread), e.g. to time the supervisor's restarts."""
    http, grpc_port = free_port(), free_port()
    log_dir.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable,
        "-m",
        "dsmesh",
        "--log-level",
        "info",  # the engines' periodic step summaries go to their logs
        "up",
        *(["--model", model] if model is not None else []),
        "--http-port",
        str(http),
        "--grpc-port",
        str(grpc_port),
        "--log-dir",
        str(log_dir),
        *up_args,
    ]
    log = log_dir / "up.log"
    print(f"$ {shlex.join(command)}", flush=True)
    sink = open(log, "w")  # noqa: SIM115 - closed below
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
    )
    try:
        deadline = time.monotonic() + start_timeout_s
        assert process.stdout is not None
        summary: list[str] | None = None  # the ready summary's lines, from "dsmesh mesh ready"
        for line in process.stdout:
            sink.write(line)
            sink.flush()
            if on_line is not None:
                on_line(line)
            if summary is not None:
                if not line.startswith(" "):  # "Ctrl-C to stop.": the summary's last line
                    break
                summary.append(line)
            elif "dsmesh mesh ready" in line:
                print(f"  {line.strip()} (log {log})", flush=True)
                summary = [line]
            if summary is None and time.monotonic() > deadline:
                raise RuntimeError(f"dsmesh up not ready in {start_timeout_s:.0f}s; see {log}")
        else:
            raise RuntimeError(f"dsmesh up exited ({process.wait()}) before ready; see {log}")
        drain = _drain_in_background(process, sink, on_line)
        gateway = f"http://127.0.0.1:{http}/metrics"
        instances = instance_metrics_urls(summary)
        yield Mesh(process, f"127.0.0.1:{grpc_port}", gateway, log, instances)
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(90)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(10)
        with contextlib.suppress(Exception):
            drain.join(5)  # type: ignore[possibly-undefined]
        sink.close()


def _drain_in_background(
    process: subprocess.Popen[str], sink: Any, on_line: Callable[[str], None] | None
):
    import threading

    def run() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            sink.write(line)
            sink.flush()
            if on_line is not None:
                on_line(line)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def py_spy(up_log: Path, prefix: Path, seconds: float) -> list[subprocess.Popen]:
    """Sample the Python stacks of every engine process of a mesh (pids from ``dsmesh up``'s
    ready lines) for ``seconds``, per thread, as collapsed stacks in ``PREFIX-NAME.txt``."""
    if shutil.which("py-spy") is None:
        print("  py-spy is not on the PATH: no stack samples", flush=True)
        return []
    spies = []
    for name, pid in re.findall(
        r"^\s+((?:prefill|decode|unified)-\d+)\s+ready at \S+\s+pid (\d+)", up_log.read_text(), re.M
    ):
        command = [
            "py-spy",
            "record",
            "--pid",
            pid,
            "--duration",
            str(int(seconds)),
            "--rate",
            "100",
            "--threads",
            "--format",
            "raw",
            "--nonblocking",
            "--output",
            f"{prefix}-{name}.txt",
        ]
        spies.append(
            subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        )
    return spies
