"""How engine processes that ``dsmesh up`` places on one GPU share it: NVIDIA's Multi-Process
Service (MPS), or the driver's time slices.

Without MPS a GPU runs one process's kernels at a time and switches between the processes'
contexts in time slices: prefill's forwards and decode's steps take turns, and neither uses
the part of the GPU that the other leaves idle. Under MPS the processes' kernels run side by
side, as one process's streams would (docs/PD.md, "One GPU for both roles").

``--gpu-sharing``:

- ``auto`` (the default): MPS when some GPU runs more than one engine process and
  ``nvidia-cuda-mps-control`` is on the PATH; time slices otherwise;
- ``mps``: MPS, or refuse to start where it cannot run;
- ``time-slice``: never MPS.

A daemon the user already runs (``CUDA_MPS_PIPE_DIRECTORY`` set for ``dsmesh up``) is used as
it is: the engine processes inherit the variable, and ``dsmesh up`` neither starts nor stops
a daemon. The daemon ``dsmesh up`` starts is the mesh's own: its pipe folder is private, so
only the mesh's engine processes connect to it, and it is stopped after the last of them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

MODES = ("auto", "mps", "time-slice")
CONTROL = "nvidia-cuda-mps-control"
PIPE_ENV = "CUDA_MPS_PIPE_DIRECTORY"
LOG_ENV = "CUDA_MPS_LOG_DIRECTORY"
THREAD_PERCENTAGE_ENV = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"  # a client's share of the SMs


class GpuSharingError(ValueError):
    """MPS was asked for and cannot run; the message says why and what to do (``dsmesh``
    prints it as a command-line error)."""


def choose(mode: str, max_processes_per_gpu: int, have_control: bool, user_daemon: bool) -> str:
    """The sharing a mesh runs with: ``"mps"`` (a daemon of the mesh's own), ``"user-mps"``
    (the user's daemon) or ``"time-slice"``. A pure policy (module docstring)."""
    if mode not in MODES:
        raise ValueError(f"--gpu-sharing must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "time-slice":
        return "time-slice"
    if user_daemon:
        return "user-mps"
    if mode == "mps":
        if not have_control:
            raise GpuSharingError(
                f"--gpu-sharing mps: {CONTROL} is not on the PATH (it ships with the NVIDIA "
                "driver); install it, or run with --gpu-sharing time-slice"
            )
        return "mps"
    return "mps" if max_processes_per_gpu > 1 and have_control else "time-slice"


class MpsDaemon:
    """An MPS control daemon for the mesh's GPUs, with a private pipe folder; its log lands
    in ``log_dir``. ``env()`` is what an engine process needs to connect to it."""

    def __init__(self, log_dir: Path, visible_gpus: Sequence[str], control: str) -> None:
        self.control = control
        self.log_dir = log_dir
        # a folder of its own under /tmp: the pipe's socket path must stay short (108 bytes)
        self.pipe_dir = Path(tempfile.mkdtemp(prefix="dsmesh-mps-"))
        self._env = {PIPE_ENV: str(self.pipe_dir), LOG_ENV: str(log_dir)}
        self._daemon_env = {**os.environ, **self._env}
        if visible_gpus:
            self._daemon_env["CUDA_VISIBLE_DEVICES"] = ",".join(visible_gpus)
        self.running = False

    def env(self) -> dict[str, str]:
        return dict(self._env)

    def start(self) -> None:
        """Start the daemon (it forks into the background and returns)."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        result = self._control(["-d"], None)
        if result.returncode != 0:
            shutil.rmtree(self.pipe_dir, ignore_errors=True)
            raise GpuSharingError(
                f"{self.control} -d exited with {result.returncode}: "
                f"{(result.stderr or result.stdout).strip()} (log: {self.log_dir}); "
                "run with --gpu-sharing time-slice to go without MPS"
            )
        self.running = True

    def stop(self) -> None:
        """Ask the daemon to quit (its server exits once no client is left)."""
        if self.running:
            self._control([], "quit\n")
            self.running = False
        shutil.rmtree(self.pipe_dir, ignore_errors=True)

    def _control(self, args: list[str], stdin: str | None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [self.control, *args],
            input=stdin,
            env=self._daemon_env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )


def start_sharing(
    mode: str,
    processes_per_gpu: Mapping[str, int],
    visible_gpus: Sequence[str],
    log_dir: Path,
    environ: Mapping[str, str] | None = None,
) -> tuple[str, MpsDaemon | None]:
    """Choose the mesh's sharing (:func:`choose`) and start its daemon when it needs one; the
    daemon sees every GPU the engine processes list in ``CUDA_VISIBLE_DEVICES``."""
    environ = os.environ if environ is None else environ
    control = shutil.which(CONTROL)
    most = max(processes_per_gpu.values(), default=0)
    chosen = choose(mode, most, control is not None, bool(environ.get(PIPE_ENV)))
    if chosen != "mps":
        return chosen, None
    assert control is not None
    daemon = MpsDaemon(log_dir, visible_gpus, control)
    daemon.start()
    return chosen, daemon
