"""Start dsmesh services as child processes and learn their ports.

Every service prints one line ``<role> ... listening on HOST:PORT`` once it serves; the
launcher waits for it (bounded), then keeps draining the child's output to a log file so the
child never blocks on a full pipe.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

# "<role> [<instance>] listening on HOST:PORT", at the start of a line (libraries log their
# own "listening on" lines, e.g. the transfer engine's).
_READY = re.compile(
    r"^(kv-broker|prefill|decode|unified|gateway|eplb)\b[^\n]* listening on (\S+):(\d+)\s*$"
)


class LaunchError(RuntimeError):
    pass


@dataclass
class ServiceProcess:
    name: str
    args: list[str]
    process: subprocess.Popen[str]
    host: str
    port: int
    log_path: Path | None
    _drain: threading.Thread | None = field(default=None, repr=False)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, timeout: float = 10.0) -> int:
        """SIGTERM, then SIGKILL after ``timeout``; returns the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        return self.process.returncode

    def kill(self) -> None:
        """SIGKILL: the crash a supervisor must survive."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(5)


_EXCEPTION = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Exit)\b.*)$", re.M)
_CLI_ERROR = re.compile(r"^(dsmesh \S+: error: .*)$", re.M)
OOM_HINT = (
    " (the GPU ran out of memory while the process started: give it more room with a "
    "smaller --max-batch-tokens or --max-total-tokens, a larger --mem-fraction, or one GPU "
    "per role)"
)


def failure_cause(output: str) -> str:
    """The line of a service's output that says why it stopped: its ``dsmesh X: error:``
    line, else the last exception a traceback ends with; out-of-memory errors get a hint."""
    found = _CLI_ERROR.findall(output) or _EXCEPTION.findall(output)
    if not found:
        return "no error line in its output (see its log)"
    cause = found[-1].strip()
    if "OutOfMemoryError" in cause or "CUDA out of memory" in cause:
        cause += OOM_HINT
    return cause


def dsmesh_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "dsmesh", *args]


def start_service(
    name: str,
    args: list[str],
    env: dict[str, str] | None = None,
    log_dir: Path | None = None,
    timeout: float = 180.0,
) -> ServiceProcess:
    """Run ``args`` and wait for its ``listening on HOST:PORT`` line."""
    log_path = log_dir / f"{name}.log" if log_dir is not None else None
    process = subprocess.Popen(
        args,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, **(env or {})},
        start_new_session=True,  # a Ctrl-C in the parent's terminal is the parent's to handle
    )
    assert process.stdout is not None
    lines: list[str] = []
    found: list[tuple[str, int]] = []
    ready = threading.Event()

    def drain() -> None:
        sink = open(log_path, "a") if log_path is not None else None  # noqa: SIM115
        try:
            for line in process.stdout:  # type: ignore[union-attr]
                if sink is not None:
                    sink.write(line)
                    sink.flush()
                if not ready.is_set():
                    lines.append(line)
                    m = _READY.search(line)
                    if m:
                        found.append((m.group(2), int(m.group(3))))
                        ready.set()
        finally:
            if sink is not None:
                sink.close()
            ready.set()

    thread = threading.Thread(target=drain, name=f"drain-{name}", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not ready.wait(0.1):
        if time.monotonic() > deadline:
            process.kill()
            raise LaunchError(f"{name} did not report its port within {timeout:.0f}s")
    if not found:
        process.wait(5)
        tail = "".join(lines[-30:])
        cause = failure_cause("".join(lines))
        raise LaunchError(
            f"{name} exited with {process.returncode} before serving: {cause}\n{tail}"
        )
    host, port = found[0]
    return ServiceProcess(name, args, process, host, port, log_path, thread)
