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
    return spawn_service(name, args, env, log_dir).wait_listening(timeout)


class Spawned:
    """A started service process whose ``listening on`` line has not been waited for yet
    (:func:`spawn_service`); its output goes to its log from the start. ``stdin``: the
    process's standard input when spawned with ``stdin=True``, else None."""

    def __init__(
        self, name: str, args: list[str], process: subprocess.Popen[str], log_path: Path | None
    ) -> None:
        self.name = name
        self.args = args
        self.process = process
        self.log_path = log_path
        self.stdin = process.stdin
        self._lines: list[str] = []
        self._found: list[tuple[str, int]] = []
        self._ready = threading.Event()
        self._drain = threading.Thread(target=self._drain_output, name=f"drain-{name}", daemon=True)
        self._drain.start()

    def _drain_output(self) -> None:
        sink = open(self.log_path, "a") if self.log_path is not None else None  # noqa: SIM115
        try:
            for line in self.process.stdout:  # type: ignore[union-attr]
                if sink is not None:
                    sink.write(line)
                    sink.flush()
                if not self._ready.is_set():
                    self._lines.append(line)
                    m = _READY.search(line)
                    if m:
                        self._found.append((m.group(2), int(m.group(3))))
                        self._ready.set()
        finally:
            if sink is not None:
                sink.close()
            self._ready.set()

    def wait_listening(self, timeout: float) -> ServiceProcess:
        """Wait for the ``listening on HOST:PORT`` line (LaunchError: none within
        ``timeout``, the process then killed, or the process exited first)."""
        deadline = time.monotonic() + timeout
        while not self._ready.wait(0.1):
            if time.monotonic() > deadline:
                self.process.kill()
                raise LaunchError(f"{self.name} did not report its port within {timeout:.0f}s")
        if not self._found:
            self.process.wait(5)
            tail = "".join(self._lines[-30:])
            cause = failure_cause("".join(self._lines))
            raise LaunchError(
                f"{self.name} exited with {self.process.returncode} before serving: {cause}\n{tail}"
            )
        host, port = self._found[0]
        return ServiceProcess(
            self.name, self.args, self.process, host, port, self.log_path, self._drain
        )


def spawn_service(
    name: str,
    args: list[str],
    env: dict[str, str] | None = None,
    log_dir: Path | None = None,
    stdin: bool = False,
) -> Spawned:
    """Start ``args`` (its output to ``log_dir``/NAME.log) without waiting for it to serve;
    ``stdin``: give it a pipe for its standard input (a ``--standby`` process waits for a line
    on it), else it has none."""
    log_path = log_dir / f"{name}.log" if log_dir is not None else None
    process = subprocess.Popen(
        args,
        stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, **(env or {})},
        start_new_session=True,  # a Ctrl-C in the parent's terminal is the parent's to handle
    )
    return Spawned(name, args, process, log_path)
