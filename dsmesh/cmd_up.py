"""``dsmesh up``: the whole mesh on this machine with one command, supervised."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from dsmesh.cli_common import add_engine_args, add_security_args, api_keys_from, tls_config_from
from dsmesh.security import ENV_API_KEYS

# Engine flags ``up`` forwards to every prefill and decode instance (``--model`` goes to every
# service). Only flags given on the command line are forwarded, so that each service keeps
# its own defaults (prefill caches prefixes by default, decode does not).
FORWARDED_ENGINE_FLAGS = (
    "device",
    "dtype",
    "page_size",
    "max_total_tokens",
    "max_running_requests",
    "max_batch_tokens",
    "attention_mode",
    "decode_attention",
)
# --x / --no-x
FORWARDED_ENGINE_SWITCHES = ("prefix_cache", "cuda_graphs", "overlap_decode", "fp8_experts")


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def register(sub: argparse._SubParsersAction) -> None:
    from dsmesh.supervisor import MeshConfig

    d = MeshConfig()
    p = sub.add_parser(
        "up",
        help="run a whole mesh locally (broker, prefill, decode, gateway), supervised",
        description="Start kv_broker, the prefill and decode instances and the gateway as "
        "separate processes, wait until all are healthy, print where to reach the mesh, "
        "restart any that dies (with backoff) and stop them all on Ctrl-C or SIGTERM.",
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
        type=_count,
        default=d.num_prefill,
        metavar="N",
        help=f"prefill instances (default {d.num_prefill})",
    )
    p.add_argument(
        "--decode",
        type=_count,
        default=d.num_decode,
        metavar="N",
        help=f"decode instances (default {d.num_decode})",
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
        "--start-timeout",
        type=_seconds,
        default=d.start_timeout_s,
        metavar="SECONDS",
        help=f"longest wait for one service to become healthy (default {d.start_timeout_s:g})",
    )
    p.add_argument(
        "--stop-timeout",
        type=_seconds,
        default=d.stop_timeout_s,
        metavar="SECONDS",
        help=f"SIGTERM to SIGKILL delay when stopping a service (default {d.stop_timeout_s:g})",
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
    add_security_args(p, api_keys=True)
    add_engine_args(p)
    # None = not given: the service's own default applies.
    p.set_defaults(**dict.fromkeys((*FORWARDED_ENGINE_FLAGS, *FORWARDED_ENGINE_SWITCHES)))
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
    ("--max-inflight", ("gateway",), int, "requests in flight at the gateway at most (429 past)"),
    ("--max-queued-tokens", ("prefill",), int, "prompt tokens queued per prefill at most"),
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
    """The engine flags given to ``up``, spelled for ``dsmesh prefill``/``decode``."""
    flags: list[str] = []
    for dest in FORWARDED_ENGINE_FLAGS:
        value = getattr(args, dest)
        if value is not None:
            flags += [f"--{dest.replace('_', '-')}", str(value)]
    for dest in FORWARDED_ENGINE_SWITCHES:
        value = getattr(args, dest)
        if value is not None:
            name = dest.replace("_", "-")
            flags.append(f"--{name}" if value else f"--no-{name}")
    for dest in ("ep_size", "num_redundant_experts"):
        if getattr(args, dest) is not None:
            flags += [f"--{dest.replace('_', '-')}", str(getattr(args, dest))]
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
    from dsmesh.supervisor import MeshConfig, run_mesh

    api_keys = api_keys_from(args)
    if api_keys:
        # to the gateway through the environment children inherit, not its command line
        # (which every local user can read in the process list)
        os.environ[ENV_API_KEYS] = ",".join(api_keys)
    config = MeshConfig(
        model=args.model,
        host=args.host,
        http_port=args.http_port,
        grpc_port=args.grpc_port,
        num_prefill=args.prefill,
        num_decode=args.decode,
        engine_args=engine_flags(args),
        broker_args=role_flags(args, "broker"),
        prefill_args=role_flags(args, "prefill"),
        decode_args=role_flags(args, "decode"),
        gateway_args=role_flags(args, "gateway"),
        gateway=args.gateway,
        eplb=args.eplb,
        eplb_args=eplb_flags(args),
        log_dir=args.log_dir,
        start_timeout_s=args.start_timeout,
        stop_timeout_s=args.stop_timeout,
        tls=tls_config_from(args),
        max_message_bytes=args.max_message_bytes,
    )
    return run_mesh(config)
