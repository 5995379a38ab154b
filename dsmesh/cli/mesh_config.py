"""``dsmesh up``'s config: the mesh to run (how many instances of each role, where), and the
shape that follows from it (its engine instances, their GPUs and metrics ports).

Each field made with ``option`` is a flag of ``dsmesh up`` (dsmesh/options/fields.py); the
rest come from the engine flags it takes and the service options it offers and forwards
(dsmesh/cli/up.py)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

from dsmesh.cli.placement import (
    EngineInstance,
    GpuList,
    Placement,
    PlacementError,
    parse_gpu_list,
    place,
)
from dsmesh.engine.ep.runtime import EP_GROUP
from dsmesh.engine.kv.budget import DEFAULT_MEM_FRACTION
from dsmesh.options import parse as argtypes
from dsmesh.options.fields import option
from dsmesh.runtime.address import LOOPBACK
from dsmesh.runtime.gpu_sharing import MODES as SHARING_MODES
from dsmesh.runtime.lifecycle import DEFAULT_DRAIN_TIMEOUT_S
from dsmesh.runtime.security import SecurityOptions

GPUS = "GPUs (CUDA meshes: --device cuda, or auto with GPUs visible; docs/DEPLOY.md)"


def _gpu_list(text: str) -> GpuList:
    try:
        return parse_gpu_list(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


@dataclass(frozen=True)
class RestartPolicy:
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 10.0
    stable_after_s: float = 30.0  # a run at least this long resets the backoff
    crash_loop_restarts: int = 5  # more restarts than this within the window = crash loop
    crash_loop_window_s: float = 60.0

    def next_delay(self, previous_s: float, ran_for_s: float) -> float:
        """Delay before the next start: none after a stable run (a crash of a process that
        served is restarted at once: its clients wait for it), then ``backoff_initial_s``,
        doubling after each quick death."""
        if ran_for_s >= self.stable_after_s:
            return 0.0
        if previous_s <= 0:
            return self.backoff_initial_s
        return min(previous_s * 2, self.backoff_max_s)


@dataclass(frozen=True)
class MeshConfig(SecurityOptions):
    model: str | None = None  # checkpoint folder (--model); None = the tiny built-in model
    # where the gateway binds; the internal services stay on loopback
    host: str = option(LOOPBACK, "address the gateway binds")
    http_port: int = option(8000, "REST port")
    # 0 = any free port, kept across gateway restarts
    grpc_port: int = option(50051, "public gRPC port (0 = any free port)")
    num_prefill: int = option(
        1,
        "prefill instances (0 with --decode 0 and --unified N)",
        flag="--prefill",
        parse=argtypes.count,
        metavar="N",
    )
    num_decode: int = option(
        1, "decode instances", flag="--decode", parse=argtypes.count, metavar="N"
    )
    num_unified: int = option(
        0,
        "unified instances, each prefilling and decoding in one engine, beside or instead of "
        "the prefill/decode pairs",
        flag="--unified",
        parse=argtypes.count,
        metavar="N",
    )
    # engine flags forwarded to every engine instance (not --device, --mem-fraction: below)
    engine_args: tuple[str, ...] = ()
    device: str | None = None  # --device; None = the services' default ("auto")
    # expert parallelism, prefill and decode only (a unified instance is one process):
    # processes per instance (None = 1, not forwarded), other EP flags as given
    ep_size: int | None = option(None, "ranks per instance", group=EP_GROUP)
    ep_args: tuple[str, ...] = ()
    # GPUs (CUDA meshes only; dsmesh/cli/placement.py): explicit lists per role, the total
    # memory fraction the processes of one GPU split, and the GPU ids children may be given
    # (None = found at start from CUDA_VISIBLE_DEVICES and torch)
    prefill_gpus: GpuList | None = option(
        None,
        "GPU ids of the prefill instances, one entry per instance, comma-separated; an EP "
        "instance's GPUs joined by '+' (0+1,2+3); ids as CUDA_VISIBLE_DEVICES lists them. "
        "Default: instances spread over the visible GPUs, one process per GPU while there are "
        "enough, else sharing them",
        parse=_gpu_list,
        metavar="LIST",
        group=GPUS,
    )
    decode_gpus: GpuList | None = option(
        None,
        "as --prefill-gpus, for the decode instances",
        parse=_gpu_list,
        metavar="LIST",
        group=GPUS,
    )
    unified_gpus: GpuList | None = option(
        None,
        "as --prefill-gpus, for the unified instances",
        parse=_gpu_list,
        metavar="LIST",
        group=GPUS,
    )
    mem_fraction: float = DEFAULT_MEM_FRACTION  # --mem-fraction, split between a GPU's processes
    visible_gpus: tuple[str, ...] | None = None
    # how engine processes on one GPU share it (dsmesh/runtime/gpu_sharing.py), and the
    # environment that connects them to the mesh's MPS daemon (set once it runs)
    gpu_sharing: str = option(
        "auto",
        "how engine processes placed on one GPU share it: mps runs them side by side under "
        "NVIDIA MPS (a daemon of the mesh's own), time-slice lets the driver switch between "
        "them; auto: MPS when a GPU runs more than one engine process and "
        "nvidia-cuda-mps-control is on the PATH (docs/PD.md)",
        choices=SHARING_MODES,
        group=GPUS,
    )
    mps_env: tuple[tuple[str, str], ...] = ()
    # under MPS, the percentage of a GPU's SMs each decode instance may use (None: all)
    decode_sm_percent: int | None = option(
        None,
        "under MPS, the percentage of a GPU's SMs each decode instance may use, so that a "
        "prefill on the same GPU keeps the rest",
        metavar="PCT",
        group=GPUS,
        default_text="no limit",
    )
    # service options given to ``up`` (dsmesh/cli/up.py, from the fields marked ``up``),
    # spelled for each role's command line
    broker_args: tuple[str, ...] = ()
    prefill_args: tuple[str, ...] = ()
    decode_args: tuple[str, ...] = ()
    gateway_args: tuple[str, ...] = ()
    log_level: str | None = None  # every child's --log-level; None = theirs
    gateway: bool = option(True, "run the gateway (--no-gateway: broker, prefill and decode only)")
    standby: bool | None = option(
        None,
        "keep a spare process per prefill, decode and unified instance, started with "
        "--standby: imported and waiting; when the instance dies the spare goes on in its "
        "place, so the restart skips the process start and imports (docs/RELIABILITY.md, "
        "Restart time); a new spare starts once it serves",
        default_text="on when the mesh runs on GPUs, off on a CPU",
    )
    # run eplb_svc; prefill and decode report to it (needs an EP group)
    eplb: bool = option(
        False,
        "also run eplb_svc; every EP instance streams its load to it and applies its "
        "placements live (docs/EPLB.md)",
        group=EP_GROUP,
    )
    eplb_args: tuple[str, ...] = ()  # flags for ``dsmesh eplb serve``
    log_dir: Path | None = option(
        None,
        "one log file per service instance here",
        parse=Path,
        default_text="a new folder under the dsmesh cache folder",
    )
    # each engine instance's Prometheus /metrics on consecutive ports from this one
    # (instance_metrics_ports); 0 = off
    instance_metrics_port: int = option(
        0,
        "serve each engine instance's Prometheus /metrics on loopback, on consecutive ports "
        "from PORT in start order (prefill, decode, unified; an EP instance takes a port per "
        "rank); listed when the mesh is ready (0 = off)",
        parse=argtypes.port,
        metavar="PORT",
    )
    start_timeout_s: float = option(
        180.0,
        "longest wait for one service to become healthy",
        parse=argtypes.seconds,
        metavar="SECONDS",
    )
    # SIGTERM drains each service (dsmesh.runtime.lifecycle): requests in flight get
    # ``drain_timeout_s``; SIGKILL follows ``stop_timeout_s`` later (None: the drain + 10 s)
    drain_timeout_s: float = option(
        DEFAULT_DRAIN_TIMEOUT_S,
        "on stop, every service stops admitting and gives the requests in flight this long "
        "to finish; the gateway drains first",
        parse=argtypes.seconds,
        metavar="SECONDS",
    )
    stop_timeout_s: float | None = option(
        None,
        "SIGTERM to SIGKILL delay when stopping a service",
        parse=argtypes.seconds,
        metavar="SECONDS",
        default_text="the drain + 10",
    )
    restart: RestartPolicy = field(default_factory=RestartPolicy)
    # ``tls`` and ``max_message_bytes`` (SecurityOptions) are forwarded to every child; the
    # supervisor's own health probes use ``tls`` too

    @property
    def kill_after_s(self) -> float:
        """SIGTERM to SIGKILL."""
        if self.stop_timeout_s is not None:
            return self.stop_timeout_s
        return self.drain_timeout_s + 10.0

    @property
    def spares(self) -> bool:
        """Whether engine instances get spare processes (``standby``; by default on GPUs:
        there a process start and its imports are 3-4 s of a restart, docs/RELIABILITY.md)."""
        if self.standby is not None:
            return self.standby
        return bool(self.visible_gpus)

    def validate(self) -> None:
        """Refuse what cannot run; with ``visible_gpus`` known, the placement too."""
        counts = {"--prefill": self.num_prefill, "--decode": self.num_decode}
        counts["--unified"] = self.num_unified
        for flag, count in counts.items():
            if count < 0:
                raise ValueError(f"{flag} must be at least 0, got {count}")
        if (self.num_prefill == 0) != (self.num_decode == 0):
            raise ValueError(
                "--prefill and --decode go together: both at least 1, or both 0 for a mesh "
                f"of --unified instances only (got --prefill {self.num_prefill} "
                f"--decode {self.num_decode})"
            )
        if self.num_prefill == 0 and self.num_unified == 0:
            raise ValueError("nothing to serve: --prefill 0 --decode 0 needs --unified N (N >= 1)")
        if self.ep_size is not None and self.ep_size < 1:
            raise ValueError(f"--ep-size must be at least 1, got {self.ep_size}")
        if self.num_prefill == 0 and (self.ep_size is not None or self.ep_args or self.eplb):
            raise ValueError(
                "expert-parallel flags (--ep-size, --num-redundant-experts, --tbo, --eplb) "
                "apply to prefill and decode instances; a --unified instance is one process"
            )
        if self.gpu_sharing not in SHARING_MODES:
            modes = ", ".join(SHARING_MODES)
            raise ValueError(f"--gpu-sharing must be one of {modes}, got {self.gpu_sharing!r}")
        if self.decode_sm_percent is not None:
            if not 1 <= self.decode_sm_percent <= 100:
                raise ValueError(
                    f"--decode-sm-percent must be in 1..100, got {self.decode_sm_percent}"
                )
            if self.gpu_sharing == "time-slice":
                raise ValueError(
                    "--decode-sm-percent limits decode under MPS: not with --gpu-sharing time-slice"
                )
        if not 0 < self.mem_fraction <= 1:
            raise ValueError(f"--mem-fraction must be in (0, 1], got {self.mem_fraction}")
        if not 0 < self.http_port <= 65535:
            raise ValueError(f"--http-port must be in 1..65535, got {self.http_port}")
        if not 0 <= self.grpc_port <= 65535:
            raise ValueError(f"--grpc-port must be in 0..65535, got {self.grpc_port}")
        if self.max_message_bytes < 1:
            raise ValueError(f"--max-message-bytes must be positive, got {self.max_message_bytes}")
        if self.eplb and self.ep_size is None and "--num-redundant-experts" not in self.ep_args:
            raise ValueError("--eplb needs expert-parallel instances: give --ep-size N")
        mesh_placement(self)


def engine_instances(config: MeshConfig) -> list[EngineInstance]:
    """Every engine instance of the mesh, in start order: prefill, decode, unified."""
    ranks = config.ep_size if config.ep_size is not None else 1
    counts = (
        ("prefill", config.num_prefill, ranks),
        ("decode", config.num_decode, ranks),
        ("unified", config.num_unified, 1),
    )
    return [EngineInstance(role, i, n) for role, count, n in counts for i in range(count)]


def instance_metrics_ports(config: MeshConfig) -> dict[str, int]:
    """Each engine instance's /metrics port, by name: consecutive from
    ``instance_metrics_port`` in start order, an EP instance's ranks on ports of their own
    (rank r of an instance on its port + r); empty when off."""
    base = config.instance_metrics_port
    if not base:
        return {}
    ports: dict[str, int] = {}
    for inst in engine_instances(config):
        ports[inst.name] = base
        base += inst.num_ranks
    return ports


def mesh_placement(config: MeshConfig) -> Placement | None:
    """Each engine instance's GPUs on a CUDA mesh (``--device cuda``/``cuda:N``, or ``auto``
    with GPUs visible); None on CPU. Raises :class:`PlacementError` naming the flag."""
    lists = {
        role: gpus
        for role, gpus in (
            ("prefill", config.prefill_gpus),
            ("decode", config.decode_gpus),
            ("unified", config.unified_gpus),
        )
        if gpus is not None
    }
    visible = config.visible_gpus or ()
    device = config.device or "auto"
    flags = ", ".join(f"--{role}-gpus" for role in lists)
    if device != "auto" and device.split(":")[0] != "cuda":
        if lists:
            raise PlacementError(f"{flags} place instances on GPUs, but --device is {device}")
        return None
    if device == "auto" and not visible:
        if lists:
            raise PlacementError(f"{flags}: no GPU is visible")
        return None
    if not visible:
        raise PlacementError(f"--device {device}: no GPU is visible")
    if ":" in device:
        if lists:
            raise PlacementError(
                f"--device {device} puts every instance on one GPU; to place them, give "
                f"--device cuda with {flags}"
            )
        index = device.split(":", 1)[1]
        if not index.isdigit() or int(index) >= len(visible):
            raise PlacementError(
                f"--device {device}: expected cuda:N with N < {len(visible)}, the GPUs visible"
            )
        visible = (visible[int(index)],)
    return place(visible, engine_instances(config), lists)
