"""``dsmesh up``: start a whole mesh as child processes, keep it running, stop it cleanly.

Stages start in order, each once the one before is healthy, and stop in reverse order:
kv_broker, (eplb_svc), prefill + decode + unified, gateway (dsmesh/cli/stages.py builds each
stage's command lines). Every service instance is a :class:`Slot` owned by one keeper thread,
which starts the process, waits until it is healthy (gRPC health SERVING, or HTTP 200 from the
gateway's ``/health``), restarts it with exponential backoff when it dies, and stops it
(SIGTERM, then SIGKILL) when asked.

A restarted engine instance may come back on a new port (the broker lists it); the broker and
the gateway come back on the same ports, which other processes and clients hold. On Linux every
child runs with ``PR_SET_PDEATHSIG``, so even a SIGKILLed ``dsmesh up`` leaves no orphans.

On a CUDA mesh every engine instance gets its GPUs through ``CUDA_VISIBLE_DEVICES``
(dsmesh/cli/placement.py) and its share of each GPU's memory through ``--mem-fraction``; the other
services see no GPU.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TextIO

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from dsmesh.cli.common import engine_config_of_flags
from dsmesh.cli.memory_plan import MemoryPlan, plan_cpu, plan_gpus
from dsmesh.cli.mesh_config import (
    MeshConfig,
    RestartPolicy,
    engine_instances,
    instance_metrics_ports,
    mesh_placement,
)
from dsmesh.cli.placement import visible_gpu_ids
from dsmesh.cli.stages import STAGES, ServiceSpec, fraction_arg, url_host
from dsmesh.runtime.address import LOOPBACK
from dsmesh.runtime.gpu_sharing import (
    PIPE_ENV,
    GpuSharingError,
    MpsDaemon,
    start_sharing,
)
from dsmesh.runtime.gpus import gpu_memory, host_memory_available
from dsmesh.runtime.grpc_server import sync_channel
from dsmesh.runtime.launcher import (
    LaunchError,
    ServiceProcess,
    Spawned,
    dsmesh_command,
    failure_cause,
    spawn_service,
)
from dsmesh.runtime.security import TLSConfig

# Run in front of every child on Linux, then exec'd away (same pid): the kernel SIGKILLs the
# child when the thread that started it ends, which includes the supervisor being SIGKILLed.
# The parent-pid check closes the race of a supervisor that died before prctl ran.
_PDEATHSIG_EXEC = (
    "import ctypes, os, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit(1)\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n"
)


class CrashLoopDetector:
    """Counts restarts in a sliding window; says when a service enters a crash loop."""

    def __init__(self, policy: RestartPolicy) -> None:
        self.policy = policy
        self._times: collections.deque[float] = collections.deque()
        self._reported = False

    def record(self, now: float) -> int | None:
        """Note a restart at ``now``; the restart count in the window when this restart
        starts a crash loop (reported once until :meth:`reset`), else None."""
        self._times.append(now)
        while self._times[0] < now - self.policy.crash_loop_window_s:
            self._times.popleft()
        if len(self._times) > self.policy.crash_loop_restarts and not self._reported:
            self._reported = True
            return len(self._times)
        return None

    def reset(self) -> None:
        """The service ran stably: a later crash loop is reported again."""
        self._reported = False


# ---------------------------------------------------------------------------------------------


class Console:
    """Progress on stdout, trouble on stderr; one line at a time across threads."""

    def __init__(self, out: TextIO | None = None, err: TextIO | None = None) -> None:
        self._out = out or sys.stdout
        self._err = err or sys.stderr
        self._lock = threading.Lock()

    def info(self, text: str) -> None:
        self._write(self._out, text)

    def warn(self, text: str) -> None:
        self._write(self._err, f"dsmesh up [{time.strftime('%H:%M:%S')}]: {text}")

    def _write(self, stream: TextIO, text: str) -> None:
        with self._lock:
            print(text, file=stream, flush=True)


def orphan_proof(command: list[str], parent_pid: int) -> list[str]:
    """``command`` made to die with ``parent_pid`` (Linux; unchanged elsewhere)."""
    if not sys.platform.startswith("linux"):
        return command
    return [sys.executable, "-S", "-c", _PDEATHSIG_EXEC, str(parent_pid), *command]


def log_tail(path: Path | None, num_lines: int = 20) -> str:
    if path is None or not path.exists():
        return "(no log)"
    lines = path.read_text(errors="replace").splitlines()[-num_lines:]
    return "\n".join(f"    {line}" for line in lines) or "    (empty log)"


def is_healthy(
    address: str, health_url: str | None, timeout: float = 1.0, tls: TLSConfig | None = None
) -> bool:
    """HTTP 200 from ``health_url`` if given, else gRPC health SERVING at ``address``
    (over TLS when ``tls`` is on)."""
    if health_url is not None:
        try:
            with urllib.request.urlopen(health_url, timeout=timeout) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError):
            return False
    with sync_channel(address, tls or TLSConfig()) as ch:
        try:
            resp = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=timeout
            )
        except grpc.RpcError:
            return False
    return resp.status == health_pb2.HealthCheckResponse.SERVING


class Slot:
    """One service instance and the keeper thread that owns its process.

    Only the keeper thread starts and stops the process: with PR_SET_PDEATHSIG a child dies
    with the thread that forked it, so the thread lives until its child is gone. With
    ``spec.standby`` the keeper also holds a spare: the same command with ``--standby``,
    started once the process serves, imported and waiting on its standard input; a restart
    lets it go on instead of starting a new process (docs/RELIABILITY.md, Restart time).
    """

    def __init__(
        self, spec: ServiceSpec, config: MeshConfig, log_dir: Path, console: Console
    ) -> None:
        self.spec = spec
        self.config = config
        self.log_path = log_dir / f"{spec.name}.log"
        self.console = console
        self.process: ServiceProcess | None = None
        self.settled = threading.Event()  # first start over: healthy, or failed
        self.failure: str | None = None
        self._log_dir = log_dir
        self._args = list(spec.args)
        self._stop = threading.Event()
        self._started_at = 0.0
        self._exited_at = 0.0  # when the last exit was seen
        self._crash_loops = CrashLoopDetector(config.restart)
        self._spare: Spawned | None = None  # with spec.standby: the next process, waiting
        self._thread = threading.Thread(target=self._run, name=f"keep-{spec.name}", daemon=True)

    @property
    def address(self) -> str:
        return self.process.address if self.process is not None else ""

    def start(self) -> None:
        self._thread.start()

    def request_stop(self) -> None:
        self._stop.set()

    def kill_now(self) -> None:
        """SIGKILL the process and its spare without waiting (safe in a signal handler)."""
        for process in (self.process, self._spare):
            if process is not None and process.process.poll() is None:
                process.process.kill()

    def join(self, timeout: float) -> bool:
        self._thread.join(timeout)
        return not self._thread.is_alive()

    # -- keeper thread ------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            if self._bring_up():
                self._start_spare()
                self._keep()
        except Exception as exc:  # a keeper never dies silently, nor leaves its child behind
            self.console.warn(f"{self.spec.name}: supervisor error {exc!r}; stopping it")
            self.failure = self.failure or f"{self.spec.name}: supervisor error {exc!r}"
            self._halt()
        finally:
            self.settled.set()

    def _bring_up(self) -> bool:
        """First start: launched and healthy (True), or failed / stop requested (False)."""
        begin = time.monotonic()
        try:
            self._launch()
        except LaunchError as exc:
            self.failure = str(exc).splitlines()[0]
            return False
        if not self._wait_healthy():
            assert self.process is not None
            died = not self.process.alive()
            self._halt()
            if not self._stop.is_set():
                self.failure = f"{self.spec.name} did not become healthy"
                if died:
                    log = self.log_path.read_text(errors="replace") if self.log_path else ""
                    self.failure = f"{self.spec.name} exited while starting: {failure_cause(log)}"
            return False
        assert self.process is not None
        if self.spec.pinned_port_flag is not None:
            index = self._args.index(self.spec.pinned_port_flag)
            self._args[index + 1] = str(self.process.port)
        self.console.info(
            f"  {self.spec.name:<12} ready at {self.address:<21} "
            f"pid {self.process.process.pid:<8} {time.monotonic() - begin:5.1f}s"
        )
        self.settled.set()
        return True

    def _spawn(self, standby: bool = False) -> Spawned:
        level = ("--log-level", self.config.log_level) if self.config.log_level else ()
        spare = ("--standby",) if standby else ()
        command = orphan_proof(dsmesh_command(*level, *self._args, *spare), os.getpid())
        try:
            return spawn_service(self.spec.name, command, self.spec.env, self._log_dir, standby)
        except OSError as exc:  # e.g. the log folder is not writable
            raise LaunchError(f"{self.spec.name} could not be started: {exc}") from exc

    def _launch(self) -> None:
        """Start the process: the spare told to go on when there is a live one, else a new
        process; wait for its ``listening on`` line."""
        spawned = self._take_spare() or self._spawn()
        self.process = spawned.wait_listening(self.config.start_timeout_s)
        self._started_at = time.monotonic()

    def _start_spare(self) -> None:
        if self.spec.standby and self._spare is None and not self._stop.is_set():
            try:
                self._spare = self._spawn(standby=True)
            except LaunchError as exc:  # restarts start a new process, as without a spare
                self.console.warn(f"{self.spec.name}: no spare: {exc}")

    def _take_spare(self) -> Spawned | None:
        """The spare, told to go on (a line on its standard input), or None when there is
        none or it has died."""
        spare, self._spare = self._spare, None
        if spare is None or spare.stdin is None or spare.process.poll() is not None:
            return None
        try:
            spare.stdin.write("go\n")
            spare.stdin.close()
        except OSError:  # it died meanwhile
            spare.process.kill()
            return None
        return spare

    def _wait_healthy(self, poll_s: float = 0.2) -> bool:
        """Whether the process became healthy, probed every ``poll_s`` (a restart probes
        every 0.05 s: its clients wait for it, and only this one service is starting)."""
        assert self.process is not None
        deadline = time.monotonic() + self.config.start_timeout_s
        while time.monotonic() < deadline and self.process.alive():
            if is_healthy(self.address, self.spec.health_url, tls=self.config.tls):
                return True
            if self._stop.wait(poll_s):
                return False
        return False

    def _keep(self) -> None:
        """Restart the process whenever it dies, until asked to stop; then stop it."""
        delay = 0.0
        while True:
            if self._wait_exit():
                self._halt()
                return
            assert self.process is not None
            self._exited_at = time.monotonic()
            ran_for = self._exited_at - self._started_at
            delay = self.config.restart.next_delay(delay, ran_for)
            if ran_for >= self.config.restart.stable_after_s:
                self._crash_loops.reset()
            self.console.warn(
                f"{self.spec.name} exited with code {self.process.process.returncode} after "
                f"{ran_for:.1f}s; restarting in {delay:.1f}s (log: {self.log_path})"
            )
            while True:
                if self._stop.wait(delay):
                    return
                if self._restart():
                    break
                delay = self.config.restart.next_delay(delay, 0.0)
                self.console.warn(f"{self.spec.name}: next try in {delay:.1f}s")

    def _wait_exit(self) -> bool:
        """Wait until the process exits (False) or a stop is requested (True). The exit is
        seen within about 50 ms (``Popen.wait``'s polling), a stop within 0.2 s."""
        assert self.process is not None
        while not self._stop.is_set():
            try:
                self.process.process.wait(0.2)
                break
            except subprocess.TimeoutExpired:
                continue
        return self._stop.is_set()

    def _restart(self) -> bool:
        self._count_restart()
        with open(self.log_path, "a") as log:
            log.write(f"\n===== dsmesh up: restarting {self.spec.name} at {time.ctime()} =====\n")
        try:
            self._launch()
        except LaunchError as exc:
            self.console.warn(f"{self.spec.name} failed to restart: {str(exc).splitlines()[0]}")
            return False
        assert self.process is not None
        state = "healthy" if self._wait_healthy(poll_s=0.05) else "NOT healthy yet"
        # from the exit seen to healthy: what a restart costs (docs/RELIABILITY.md, Restart time)
        self.console.warn(
            f"{self.spec.name} restarted at {self.address} (pid {self.process.process.pid}), "
            f"{state} {time.monotonic() - self._exited_at:.1f}s after it exited"
        )
        self._start_spare()
        return True

    def _count_restart(self) -> None:
        count = self._crash_loops.record(time.monotonic())
        if count is not None:
            policy = self.config.restart
            self.console.warn(
                f"!!! {self.spec.name} IS CRASH-LOOPING: {count} restarts in the last "
                f"{policy.crash_loop_window_s:.0f}s; still retrying, backing off up to "
                f"{policy.backoff_max_s:.0f}s. Last lines of {self.log_path}:\n"
                f"{log_tail(self.log_path)}"
            )

    def _halt(self) -> None:
        spare, self._spare = self._spare, None
        if spare is not None and spare.process.poll() is None:
            spare.process.kill()  # idle: nothing to drain
            spare.process.wait(5)
        if self.process is not None and self.process.alive():
            code = self.process.stop(self.config.kill_after_s)
            self.console.info(f"  {self.spec.name:<12} stopped (exit code {code})")


class Supervisor:
    """Brings the mesh up stage by stage, then lets the slots keep it running."""

    def __init__(self, config: MeshConfig, log_dir: Path, console: Console) -> None:
        self.config = config
        self.log_dir = log_dir
        self.console = console
        self.stages: list[list[Slot]] = []
        # A plain flag, not a threading.Event: a signal handler sets it, and Event.set could
        # deadlock on the lock that the interrupted main thread holds.
        self.stop_requested = False

    def request_stop(self) -> None:
        """First call: stop gracefully. A later call (a second Ctrl-C): SIGKILL every child."""
        if self.stop_requested:
            for slot in self.slots:
                slot.kill_now()
        self.stop_requested = True

    @property
    def slots(self) -> list[Slot]:
        return [slot for stage in self.stages for slot in stage]

    def start(self) -> bool:
        """Start every stage in order; False if one failed or a stop was requested."""
        addresses: dict[str, str] = {}
        for build in STAGES:
            specs = build(self.config, addresses)
            if not specs:
                continue
            stage = [Slot(spec, self.config, self.log_dir, self.console) for spec in specs]
            self.stages.append(stage)
            for slot in stage:
                slot.start()
            if not self._wait_settled(stage):
                return False
            for slot in stage:
                addresses.setdefault(slot.spec.name, slot.address)
        return True

    def _wait_settled(self, stage: list[Slot]) -> bool:
        while not self.stop_requested:
            # read settled before failure: a keeper records its failure, then settles
            settled = all(slot.settled.is_set() for slot in stage)
            failed = [slot for slot in stage if slot.failure is not None]
            if failed:
                for slot in failed:
                    self.console.warn(
                        f"{slot.failure}\n  last lines of {slot.log_path}:\n"
                        f"{log_tail(slot.log_path)}"
                    )
                return False
            if settled:
                return True
            time.sleep(0.1)
        return False

    def stop(self) -> None:
        """Stop stage by stage, last started first; each slot SIGTERMs, then SIGKILLs."""
        for stage in reversed(self.stages):
            for slot in stage:
                slot.request_stop()
            # A slot inside a (re)start cannot stop before its child reports ready; past this
            # bound it is left behind, and the supervisor's exit kills that child
            # (PR_SET_PDEATHSIG).
            bound = self.config.kill_after_s + 5.0
            for slot in stage:
                if not slot.join(bound):
                    self.console.warn(f"{slot.spec.name} still starting; killed on exit")

    def summary(self, elapsed_s: float) -> str:
        c = self.config
        broker = self.stages[0][0].address
        lines = [f"dsmesh mesh ready in {elapsed_s:.1f}s"]
        if c.gateway:
            base = f"http://{url_host(c.host)}:{c.http_port}"
            gateway = next(s for s in self.slots if s.spec.name == "gateway")
            lines += [
                f"  REST     {base}",
                f"  OpenAI   {base}/v1",
                f"  gRPC     {gateway.address}",
                f"  metrics  {base}/metrics",
            ]
        lines += [f"  broker   {broker}", *placement_lines(c), *instance_metrics_lines(c)]
        lines += [f"  logs     {self.log_dir}", "Ctrl-C to stop."]
        return "\n".join(lines)


def instance_metrics_lines(config: MeshConfig) -> list[str]:
    """The summary's lines for ``--instance-metrics-port``: each engine instance's /metrics
    URL (the benchmarks read them: dsmesh/bench/mesh_metrics.py)."""
    lines = []
    for i, (name, port) in enumerate(instance_metrics_ports(config).items()):
        label = "metrics" if i == 0 else ""
        lines.append(f"  {label:<8} {name:<12} http://{LOOPBACK}:{port}/metrics")
    return lines


def placement_lines(config: MeshConfig) -> list[str]:
    """The summary's lines for a CUDA mesh: each engine instance's GPUs and memory share."""
    placement = mesh_placement(config)
    if placement is None:
        return []
    lines = []
    for i, (name, gpu_ids) in enumerate(placement.gpu_ids.items()):
        fraction = fraction_arg(placement.mem_fraction(name, config.mem_fraction))
        label = "gpus" if i == 0 else ""
        lines.append(f"  {label:<8} {name:<12} GPU {'+'.join(gpu_ids):<8} mem-fraction {fraction}")
    return lines


def share_gpus(
    config: MeshConfig, log_dir: Path, console: Console
) -> tuple[MeshConfig, MpsDaemon | None]:
    """On a CUDA mesh, how its engine processes share GPUs (dsmesh/runtime/gpu_sharing.py): the
    config with the environment that connects them to the MPS daemon started here, if any."""
    placement = mesh_placement(config)
    if placement is None:
        return config, None
    per_gpu = placement.processes_per_gpu
    visible = config.visible_gpus or tuple(per_gpu)
    try:
        sharing, daemon = start_sharing(config.gpu_sharing, per_gpu, visible, log_dir / "mps")
    except GpuSharingError as exc:
        if config.gpu_sharing != "auto":
            raise
        console.warn(f"{exc}; going on without MPS")  # auto: time slices still work
        sharing, daemon = "time-slice", None
    if max(per_gpu.values(), default=0) > 1 or config.gpu_sharing != "auto":
        console.info(f"dsmesh up: GPU sharing {SHARING_LABELS[sharing]}")
    if sharing == "user-mps":  # the children inherit it; named so that decode's limit applies
        return dataclasses.replace(config, mps_env=((PIPE_ENV, os.environ[PIPE_ENV]),)), None
    if daemon is None:
        return config, None
    return dataclasses.replace(config, mps_env=tuple(daemon.env().items())), daemon


SHARING_LABELS = {
    "mps": "MPS (a daemon of this mesh's own)",
    "user-mps": "MPS (the daemon of CUDA_MPS_PIPE_DIRECTORY)",
    "time-slice": "time slices (no MPS)",
}


def default_log_dir() -> Path:
    from dsmesh.engine.model.tiny_model import cache_root

    parent = cache_root() / "logs"
    parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=time.strftime("up-%Y%m%d-%H%M%S-"), dir=parent))


def resolve_model(model: str | None) -> str:
    """The checkpoint folder every child gets; builds the default model once, up front, so
    that children do not race to build it. The default is the tiny model with DeepSeek-V3's
    own tokenizer and chat template, so tools, structured outputs and reasoning work on it."""
    if model is None:
        from dsmesh.engine.model.tiny_model import default_model_dir

        return str(default_model_dir(tokenizer="deepseek-v3"))
    folder = Path(model).expanduser().resolve()
    if not folder.is_dir():
        raise FileNotFoundError(f"--model {model}: no such folder")
    return str(folder)


def plan_memory(config: MeshConfig) -> MemoryPlan:
    """Every engine process's memory, from the model's shape and the flags given, against
    each GPU's memory (or the host's); raises MemoryPlanError with the numbers and the fixes
    when it cannot fit (dsmesh/cli/memory_plan.py)."""
    from dsmesh.engine.model.config import load_config
    from dsmesh.kernels._triton import triton_importable

    assert config.model is not None
    mc = load_config(config.model)
    engine = engine_config_of_flags(config.engine_args)
    if config.device is not None:
        engine = dataclasses.replace(engine, device=config.device)
    instances = engine_instances(config)
    placement = mesh_placement(config)
    if placement is None:
        return plan_cpu(instances, engine, mc, host_memory_available())
    used = [g for g, n in placement.processes_per_gpu.items() if n]
    return plan_gpus(
        instances,
        placement,
        engine,
        mc,
        gpu_memory(used),
        config.mem_fraction,
        fp8_kernels=triton_importable() and engine.kernels == "auto",
    )


def resolve_visible_gpus(config: MeshConfig) -> tuple[str, ...]:
    """The GPU ids children may be given: ``config.visible_gpus`` when set; none for a CPU
    mesh; else this process's ``CUDA_VISIBLE_DEVICES`` entries, or all GPUs torch sees."""
    if config.visible_gpus is not None:
        return config.visible_gpus
    device = config.device or "auto"
    if device != "auto" and device.split(":")[0] != "cuda":
        return ()
    import torch

    count = torch.cuda.device_count()
    return visible_gpu_ids(os.environ.get("CUDA_VISIBLE_DEVICES"), count)


@contextmanager
def stop_on_signals(on_signal: Callable[[], None]) -> Iterator[None]:
    """SIGINT/SIGTERM/SIGHUP call ``on_signal`` (in the main thread only) instead of raising."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    sigs = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {sig: signal.signal(sig, lambda *_: on_signal()) for sig in sigs}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run_mesh(config: MeshConfig, console: Console | None = None) -> int:
    """Run the mesh until SIGINT/SIGTERM (exit 0); 1 if it could not be started."""
    console = console or Console()
    config = dataclasses.replace(config, visible_gpus=resolve_visible_gpus(config))
    config.validate()
    config = dataclasses.replace(config, model=resolve_model(config.model))
    plan = plan_memory(config)  # refuses what cannot fit before anything starts
    log_dir = Path(config.log_dir) if config.log_dir is not None else default_log_dir()
    log_dir.mkdir(parents=True, exist_ok=True)
    console.info(f"dsmesh up: model {config.model}\ndsmesh up: logs  {log_dir}")
    console.info("dsmesh up: memory plan\n" + "\n".join(plan.lines()))
    config, daemon = share_gpus(config, log_dir, console)
    supervisor = Supervisor(config, log_dir, console)
    begin = time.monotonic()
    started = False
    with stop_on_signals(supervisor.request_stop):
        try:
            started = supervisor.start()
            if started:
                console.info(supervisor.summary(time.monotonic() - begin))
                while not supervisor.stop_requested:
                    time.sleep(0.2)
        finally:
            if supervisor.stages:
                console.info("dsmesh up: stopping")
            supervisor.stop()
            if daemon is not None:
                daemon.stop()
    if started or supervisor.stop_requested:
        console.info("dsmesh up: stopped")
        return 0
    console.warn("could not start the mesh; stopped what had started")
    return 1
