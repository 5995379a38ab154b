"""``dsmesh up``: the whole mesh on this machine with one command, supervised."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import TYPE_CHECKING

from dsmesh.cli.common import (
    add_engine_args,
    add_security_args,
    api_keys_from,
    engine_flags_given,
    tls_config_from,
)
from dsmesh.cli.gpu_sharing import MODES as SHARING_MODES
from dsmesh.cli.placement import parse_gpu_list
from dsmesh.engine.kv_budget import DEFAULT_MEM_FRACTION
from dsmesh.runtime import argtypes
from dsmesh.runtime.security import ENV_API_KEYS

if TYPE_CHECKING:
    from dsmesh.cli.supervisor import MeshConfig

def _gpu_list(text: str):
    try:
        return parse_gpu_list(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def register(sub: argparse._SubParsersAction) -> None:
    from dsmesh.cli.supervisor import MeshConfig

    d = MeshConfig()
    p = sub.add_parser(
        "up",
        help="run a whole mesh locally (broker, prefill, decode, gateway), supervised",
        description="Start kv_broker, the prefill, decode and unified instances and the "
        "gateway as separate processes, wait until all are healthy, print where to reach the "
        "mesh, restart any that dies (with backoff) and stop them all on Ctrl-C or SIGTERM. "
        "On GPUs each instance gets its own GPUs and its share of their memory (docs/DEPLOY.md).",
    )
    p.add_argument("--host", default=d.host, help=f"address the gateway binds (default {d.host})")
    p.add_argument(
        "--http-port", type=int, default=d.http_port, help=f"REST port (default {d.http_port})"
    )
    p.add_argument(
        "--grpc-port",
        type=int,
        default=d.grpc_port,
        help=f"public gRPC port (default {d.grpc_port}; 0 = any free port)",
    )
    p.add_argument(
        "--prefill",
        type=argtypes.count,
        default=d.num_prefill,
        metavar="N",
        help=f"prefill instances (default {d.num_prefill}; 0 with --decode 0 and --unified N)",
    )
    p.add_argument(
        "--decode",
        type=argtypes.count,
        default=d.num_decode,
        metavar="N",
        help=f"decode instances (default {d.num_decode})",
    )
    p.add_argument(
        "--unified",
        type=argtypes.count,
        default=d.num_unified,
        metavar="N",
        help="unified instances, each prefilling and decoding in one engine, beside or "
        f"instead of the prefill/decode pairs (default {d.num_unified})",
    )
    p.add_argument(
        "--gateway",
        action=argparse.BooleanOptionalAction,
        default=d.gateway,
        help="run the gateway (--no-gateway: broker, prefill and decode only)",
    )
    p.add_argument(
        "--log-dir",
        type=Path,
        default=None,
        help="one log file per service instance here (default: a new folder under the "
        "dsmesh cache folder)",
    )
    p.add_argument(
        "--instance-metrics-port",
        type=argtypes.port,
        default=d.instance_metrics_port,
        metavar="PORT",
        help="serve each engine instance's Prometheus /metrics on loopback, on consecutive "
        "ports from PORT in start order (prefill, decode, unified; an EP instance takes a "
        "port per rank); listed when the mesh is ready (default: 0 = off)",
    )
    p.add_argument(
        "--start-timeout",
        type=argtypes.seconds,
        default=d.start_timeout_s,
        metavar="SECONDS",
        help=f"longest wait for one service to become healthy (default {d.start_timeout_s:g})",
    )
    p.add_argument(
        "--drain-timeout",
        type=argtypes.seconds,
        default=d.drain_timeout_s,
        metavar="SECONDS",
        help="on stop, every service stops admitting and gives the requests in flight this "
        f"long to finish; the gateway drains first (default {d.drain_timeout_s:g})",
    )
    p.add_argument(
        "--stop-timeout",
        type=argtypes.seconds,
        default=None,
        metavar="SECONDS",
        help="SIGTERM to SIGKILL delay when stopping a service (default: the drain + 10)",
    )
    g = p.add_argument_group(
        "bounds and limits (forwarded to the services that own them; default: theirs)"
    )
    for flag, _, kind, text in ROLE_FLAGS:
        g.add_argument(flag, type=kind, default=None, help=text)
    g = p.add_argument_group("expert parallelism (docs/EP.md; forwarded to prefill and decode)")
    g.add_argument("--ep-size", type=int, default=None, help="ranks per instance")
    g.add_argument("--num-redundant-experts", type=int, default=None, help="extra expert replicas")
    g.add_argument(
        "--tbo", action=argparse.BooleanOptionalAction, default=None, help="two-batch overlap"
    )
    g.add_argument(
        "--eplb",
        action="store_true",
        help="also run eplb_svc; every EP instance streams its load to it and applies its "
        "placements live (docs/EPLB.md)",
    )
    g.add_argument(
        "--eplb-interval", type=float, default=None, help="seconds between EPLB decisions"
    )
    g.add_argument(
        "--eplb-threshold", type=float, default=None, help="balancedness gain that applies one"
    )
    g = p.add_argument_group(
        "GPUs (CUDA meshes: --device cuda, or auto with GPUs visible; docs/DEPLOY.md)"
    )
    g.add_argument(
        "--prefill-gpus",
        type=_gpu_list,
        default=None,
        metavar="LIST",
        help="GPU ids of the prefill instances, one entry per instance, comma-separated; an "
        "EP instance's GPUs joined by '+' (0+1,2+3); ids as CUDA_VISIBLE_DEVICES lists them. "
        "Default: instances spread over the visible GPUs, one process per GPU while there "
        "are enough, else sharing them",
    )
    for role in ("decode", "unified"):
        g.add_argument(
            f"--{role}-gpus",
            type=_gpu_list,
            default=None,
            metavar="LIST",
            help=f"as --prefill-gpus, for the {role} instances",
        )
    g.add_argument(
        "--gpu-sharing",
        choices=SHARING_MODES,
        default=d.gpu_sharing,
        help="how engine processes placed on one GPU share it: mps runs them side by side "
        "under NVIDIA MPS (a daemon of the mesh's own), time-slice lets the driver switch "
        "between them; auto: MPS when a GPU runs more than one engine process and "
        "nvidia-cuda-mps-control is on the PATH (docs/PD.md)",
    )
    g.add_argument(
        "--decode-sm-percent",
        type=int,
        default=None,
        metavar="PCT",
        help="under MPS, the percentage of a GPU's SMs each decode instance may use, so that "
        "a prefill on the same GPU keeps the rest (default: no limit)",
    )
    add_security_args(p, api_keys=True)
    # Not given: None, and the service's own default (or derived value) applies. Only the
    # flags given are forwarded to the engine instances (dsmesh/runtime/options.py).
    add_engine_args(
        p,
        not_given=True,
        mem_fraction_help="fraction of each GPU's memory for the weights + KV pools of the "
        "processes on it, split evenly between them (each gets --mem-fraction F/k); the rest "
        f"is left for activations and CUDA graphs (default {DEFAULT_MEM_FRACTION})",
    )
    p.set_defaults(func=run)


# flag, services it goes to, type, help
ROLE_FLAGS: tuple[tuple[str, tuple[str, ...], type, str], ...] = (
    (
        "--handoff-timeout",
        ("decode", "gateway"),
        float,
        "seconds a request may wait for its prompt's KV (decode, gateway)",
    ),
    (
        "--liveness-grace",
        ("broker",),
        float,
        "seconds before kv_broker declares a silent instance gone",
    ),
    (
        "--release-quarantine",
        ("decode",),
        float,
        "longest wait for prefill to release a failed handoff's pages (decode)",
    ),
    ("--max-inflight", ("gateway",), int, "requests the gateway dispatches at most (more queue)"),
    ("--max-queued", ("gateway",), int, "requests queued at the gateway at most (429 past)"),
    (
        "--kv-routing-weight",
        ("gateway",),
        float,
        "KV-aware routing: a cached prompt token against a token of load; 0: load alone",
    ),
    ("--max-queued-tokens", ("prefill",), int, "prompt tokens queued per prefill at most"),
    (
        "--reasoning-parser",
        ("gateway",),
        str,
        "deepseek-r1: chat's <think>...</think> goes to reasoning_content (gateway)",
    ),
)


def role_flags(args: argparse.Namespace, role: str) -> tuple[str, ...]:
    """The bounds given to ``up`` that belong to ``role``'s command line."""
    out: list[str] = []
    for flag, roles, _, _ in ROLE_FLAGS:
        value = getattr(args, flag.lstrip("-").replace("-", "_"))
        if value is not None and role in roles:
            out += [flag, str(value)]
    return tuple(out)


def engine_flags(args: argparse.Namespace) -> tuple[str, ...]:
    """The engine flags given to ``up``, spelled for ``dsmesh prefill``/``decode``/``unified``
    (``--device`` and ``--mem-fraction`` go through the supervisor, which places instances
    on GPUs; ``--model`` goes to every service)."""
    return engine_flags_given(args)


def ep_flags(args: argparse.Namespace) -> tuple[str, ...]:
    """The expert-parallel flags given to ``up`` (but --ep-size), for prefill and decode."""
    flags: list[str] = []
    if args.num_redundant_experts is not None:
        flags += ["--num-redundant-experts", str(args.num_redundant_experts)]
    if args.tbo is not None:
        flags.append("--tbo" if args.tbo else "--no-tbo")
    return tuple(flags)


def eplb_flags(args: argparse.Namespace) -> tuple[str, ...]:
    flags: list[str] = []
    if args.eplb_interval is not None:
        flags += ["--interval", str(args.eplb_interval)]
    if args.eplb_threshold is not None:
        flags += ["--threshold", str(args.eplb_threshold)]
    return tuple(flags)


def run(args: argparse.Namespace) -> int:
    from dsmesh.cli.supervisor import run_mesh

    api_keys = api_keys_from(args)
    if api_keys:
        # to the gateway through the environment children inherit, not its command line
        # (which every local user can read in the process list)
        os.environ[ENV_API_KEYS] = ",".join(api_keys)
    return run_mesh(mesh_config_from(args))


def mesh_config_from(args: argparse.Namespace) -> MeshConfig:
    """``up``'s flags as the supervisor's config (the one place they map onto it)."""
    from dsmesh.cli.supervisor import MeshConfig

    log_level = getattr(args, "log_level", "WARNING")
    return MeshConfig(
        model=args.model,
        host=args.host,
        http_port=args.http_port,
        grpc_port=args.grpc_port,
        num_prefill=args.prefill,
        num_decode=args.decode,
        num_unified=args.unified,
        engine_args=engine_flags(args),
        device=args.device,
        ep_size=args.ep_size,
        ep_args=ep_flags(args),
        prefill_gpus=args.prefill_gpus,
        decode_gpus=args.decode_gpus,
        unified_gpus=args.unified_gpus,
        mem_fraction=args.mem_fraction if args.mem_fraction is not None else DEFAULT_MEM_FRACTION,
        gpu_sharing=args.gpu_sharing,
        decode_sm_percent=args.decode_sm_percent,
        broker_args=role_flags(args, "broker"),
        prefill_args=role_flags(args, "prefill"),
        decode_args=role_flags(args, "decode"),
        gateway_args=role_flags(args, "gateway"),
        log_level=None if log_level.upper() == "WARNING" else log_level,
        gateway=args.gateway,
        eplb=args.eplb,
        eplb_args=eplb_flags(args),
        log_dir=args.log_dir,
        instance_metrics_port=args.instance_metrics_port,
        start_timeout_s=args.start_timeout,
        drain_timeout_s=args.drain_timeout,
        stop_timeout_s=args.stop_timeout,
        tls=tls_config_from(args),
        max_message_bytes=args.max_message_bytes,
    )
