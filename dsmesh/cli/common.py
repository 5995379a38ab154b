"""Command-line flags shared by sub-commands, mapped onto the frozen configs in one place."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from dsmesh.engine.engine_config import EngineConfig
from dsmesh.runtime import argtypes
from dsmesh.runtime.address import (
    LOOPBACK,
    advertise_host,
    ep_master_addr,
    host_port,
    interface_of,
    unbracket,
)
from dsmesh.runtime.lifecycle import DEFAULT_DRAIN_TIMEOUT_S
from dsmesh.runtime.options import add_options, from_args, given_flags
from dsmesh.runtime.security import (
    DEFAULT_MAX_MESSAGE_BYTES,
    TLSConfig,
    api_keys_from_env_and_args,
)

# Python's 5 ms switch interval let the event loop (64 gRPC streams) hold the GIL while the
# engine thread waited to launch the next step: measured on one H200 (unified instance,
# V2-Lite, 64 streams), 0.5 ms gave 2.4x the output tokens/s and half the TPOT.
GIL_SWITCH_MS = 0.5


def add_engine_args(
    p: argparse.ArgumentParser, *, not_given: bool = False, mem_fraction_help: str | None = None
) -> None:
    """The engine's flags: one per option field of :class:`EngineConfig` (its type, default
    and help; dsmesh/runtime/options.py), and the process flag ``--gil-switch-ms``.
    ``not_given``: every flag defaults to None (``dsmesh up``, which forwards only the
    flags given)."""
    g = p.add_argument_group("engine (docs/OPTIONS.md)")
    add_options(g, EngineConfig, not_given=not_given)
    if mem_fraction_help is not None:
        for action in g._group_actions:
            if action.dest == "mem_fraction":
                action.help = mem_fraction_help
    g.add_argument(
        "--gil-switch-ms",
        type=float,
        default=None if not_given else GIL_SWITCH_MS,
        metavar="MS",
        help="Python's thread switch interval in this process, i.e. how long the engine "
        "thread may wait for the GIL while the gRPC thread streams (default "
        f"{GIL_SWITCH_MS}; Python's own is 5: 2.4x less throughput for a unified instance "
        "at 64 streams on an H200, docs/BENCHMARKS.md)",
    )


def apply_process_flags(args: argparse.Namespace) -> None:
    """Process-wide settings an engine command takes, applied once at start-up."""
    switch_ms = getattr(args, "gil_switch_ms", None)
    if switch_ms is not None:
        if not switch_ms > 0:
            raise ValueError(f"--gil-switch-ms must be positive, got {switch_ms}")
        sys.setswitchinterval(switch_ms / 1000)


def engine_config_from(args: argparse.Namespace) -> EngineConfig:
    """The engine's options from parsed flags; ``--tbo`` comes with the EP flags."""
    return from_args(EngineConfig, args, tbo=getattr(args, "tbo", False))


def engine_config_of_flags(flags: Sequence[str]) -> EngineConfig:
    """The engine options that ``flags`` (engine flags as a command line spells them) give,
    the rest at their defaults: what ``dsmesh up`` plans with for the flags it forwards."""
    parser = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    add_engine_args(parser)
    return engine_config_from(parser.parse_args(list(flags)))


def engine_flags_given(args: argparse.Namespace) -> tuple[str, ...]:
    """The engine flags given to a command parsed with ``not_given`` (``dsmesh up``), spelled
    for the engine processes it starts: the options marked to be forwarded, and
    ``--gil-switch-ms``."""
    flags = list(given_flags(EngineConfig, args))
    if getattr(args, "gil_switch_ms", None) is not None:
        flags += ["--gil-switch-ms", str(args.gil_switch_ms)]
    return tuple(flags)


def add_ep_args(p: argparse.ArgumentParser, multi_node: bool = True) -> None:
    g = p.add_argument_group("expert parallelism (docs/EP.md)")
    g.add_argument(
        "--ep-size",
        type=int,
        default=1,
        help="expert-parallel ranks (processes, one per GPU; gloo on CPU, NCCL on GPU); "
        "requests are spread over the ranks (DP attention)",
    )
    g.add_argument(
        "--num-redundant-experts",
        type=int,
        default=0,
        help="extra physical expert replicas (logical + R must divide by --ep-size)",
    )
    g.add_argument(
        "--tbo",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="two-batch overlap: each forward runs as two micro-batches whose MoE "
        "dispatch/combine overlaps the other's compute",
    )
    g.add_argument(
        "--moe-dispatch",
        default="auto",
        choices=("auto", "all-to-all", "deepep"),
        help="token dispatch between ranks: auto = DeepEP when deep_ep imports on Hopper GPUs "
        "with NCCL (normal mode on prefill, low-latency on decode), else torch all-to-all",
    )
    if not multi_node:
        return
    g.add_argument(
        "--ep-nnodes",
        type=int,
        default=1,
        help="hosts the group spans; each runs ep-size / ep-nnodes ranks (default 1)",
    )
    g.add_argument(
        "--ep-node-rank", type=int, default=0, help="this host's index in the group (default 0)"
    )
    g.add_argument(
        "--ep-master-addr",
        default="",
        metavar="HOST",
        help="address of node 0, where the group's rendezvous listens (default: 127.0.0.1 "
        "for one host; node 0's advertised host when the group spans hosts; required on "
        "the other nodes)",
    )
    g.add_argument(
        "--ep-master-port",
        type=int,
        default=0,
        help="rendezvous port on node 0 (0 = any free port; single host only)",
    )
    g.add_argument(
        "--eplb",
        default="",
        metavar="HOST:PORT",
        help="eplb_svc address: stream expert load to it and apply its placements live "
        "(docs/EPLB.md); needs --ep-size > 1 or redundant experts",
    )
    g.add_argument(
        "--eplb-report-interval",
        type=float,
        default=1.0,
        help="seconds between expert-load reports to eplb_svc (default 1)",
    )
    g.add_argument(
        "--ep-timeout",
        type=float,
        default=120.0,
        help="seconds a collective may wait for a peer before the group is declared broken",
    )


def ep_config_from(
    args: argparse.Namespace, deepep_mode: str = "normal", advertised: str = LOOPBACK
):
    """``advertised``: this process's advertised host; with ``--ep-nnodes`` > 1 it is node 0's
    rendezvous address by default, and its interface carries the group's gloo/NCCL traffic."""
    from dsmesh.engine.ep.runtime import EPConfig

    nnodes = getattr(args, "ep_nnodes", 1)
    node_rank = getattr(args, "ep_node_rank", 0)
    ep = EPConfig(
        dispatch=args.moe_dispatch,
        deepep_mode=deepep_mode,
        ep_size=args.ep_size,
        num_redundant_experts=args.num_redundant_experts,
        master_addr=ep_master_addr(
            getattr(args, "ep_master_addr", ""), nnodes, node_rank, advertised
        ),
        master_port=getattr(args, "ep_master_port", 0),
        nnodes=nnodes,
        node_rank=node_rank,
        timeout_s=getattr(args, "ep_timeout", 120.0),
        socket_ifname=(interface_of(advertised) or "") if nnodes > 1 else "",
    )
    ep.validate()
    return ep


def add_host_args(p: argparse.ArgumentParser, default_host: str = LOOPBACK) -> None:
    """``--host`` (what the server binds) and ``--advertise-host`` (what peers dial)."""
    p.add_argument(
        "--host",
        default=default_host,
        help=f"address to bind (default {default_host}; 0.0.0.0 or :: for every interface)",
    )
    p.add_argument(
        "--advertise-host",
        default="",
        metavar="HOST",
        help="address peers dial to reach this process, registered with kv_broker and printed "
        "in the 'listening on' line (default: --host, or the address of the default route's "
        "interface when --host binds every interface; docs/DEPLOY.md, 'Addresses')",
    )


def add_server_args(p: argparse.ArgumentParser, default_port: int = 0) -> None:
    add_host_args(p)
    p.add_argument(
        "--port", type=argtypes.port, default=default_port, help="gRPC port (0 = any free port)"
    )
    p.add_argument("--instance-id", default="", help="instance name (default: role-host-pid-rand)")
    p.add_argument(
        "--metrics-port",
        type=argtypes.port,
        default=0,
        help="serve Prometheus /metrics here (0 = off)",
    )
    add_drain_arg(p)


def add_instance_args(p: argparse.ArgumentParser) -> None:
    """The flags every prefill and decode instance takes, after its own."""
    add_server_args(p)
    add_transfer_args(p)
    add_security_args(p)
    add_ep_args(p)
    add_engine_args(p)


def add_transfer_args(p: argparse.ArgumentParser) -> None:
    from dsmesh.runtime.transfer.protocol import PROTOCOLS

    g = p.add_argument_group("KV transfer (Mooncake Transfer Engine)")
    g.add_argument("--broker", required=True, help="kv_broker address HOST:PORT")
    g.add_argument(
        "--transfer-protocol",
        default="auto",
        choices=PROTOCOLS,
        help="how KV bytes move: auto = tcp for a CPU pool, nvlink_intra (CUDA IPC) for a "
        "GPU pool whose peers are on this host (--transfer-hostname on loopback), else rdma "
        "(GPUDirect RDMA, needs an RDMA NIC); tcp refuses a GPU pool (docs/PD.md)",
    )
    g.add_argument(
        "--transfer-hostname",
        default="",
        metavar="HOST",
        help="address peers use to reach this process's transfer engine (default: the "
        "advertised host, --advertise-host)",
    )
    g.add_argument("--transfer-device", default="", help='RDMA devices, e.g. "mlx5_0,mlx5_1"')


def transfer_config_from(args: argparse.Namespace, advertised: str):
    """``advertised``: the process's advertised host, the transfer engine's by default."""
    from dsmesh.instance.attach import TransferConfig

    return TransferConfig(
        protocol=args.transfer_protocol,
        hostname=unbracket(args.transfer_hostname) or advertised,
        device_name=args.transfer_device,
    )


def add_security_args(p: argparse.ArgumentParser, api_keys: bool = False) -> None:
    """TLS for every gRPC server and channel of the process, message size limit, and (gateway,
    ``up``) API keys. Unset flags fall back to the environment (docs/SECURITY.md)."""
    g = p.add_argument_group("security (docs/SECURITY.md)")
    g.add_argument(
        "--tls-cert", default=None, metavar="PEM", help="certificate chain (env DSMESH_TLS_CERT)"
    )
    g.add_argument("--tls-key", default=None, metavar="PEM", help="its key (env DSMESH_TLS_KEY)")
    g.add_argument(
        "--tls-ca",
        default=None,
        metavar="PEM",
        help="CA that verifies peers (env DSMESH_TLS_CA)",
    )
    g.add_argument(
        "--tls-client-auth",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="servers require client certificates: mTLS (env DSMESH_TLS_CLIENT_AUTH=1)",
    )
    g.add_argument(
        "--tls-server-name",
        default=None,
        metavar="NAME",
        help="name expected in servers' certificates instead of the dialled host "
        "(env DSMESH_TLS_SERVER_NAME)",
    )
    g.add_argument(
        "--max-message-bytes",
        type=int,
        default=DEFAULT_MAX_MESSAGE_BYTES,
        metavar="N",
        help="largest gRPC message sent or received; beyond it RESOURCE_EXHAUSTED "
        f"(default {DEFAULT_MAX_MESSAGE_BYTES})",
    )
    if api_keys:
        g.add_argument(
            "--api-key",
            action="append",
            default=None,
            metavar="KEY",
            help="require 'Authorization: Bearer KEY' on HTTP and gRPC (repeatable; env "
            "DSMESH_API_KEYS=k1,k2, which keeps keys out of the process list)",
        )


def add_drain_arg(p: argparse.ArgumentParser) -> None:
    """A server's drain on SIGTERM (docs/RELIABILITY.md, "Drain")."""
    p.add_argument(
        "--drain-timeout",
        type=argtypes.seconds_or_zero,
        default=DEFAULT_DRAIN_TIMEOUT_S,
        metavar="SECONDS",
        help="on SIGTERM: stop admitting (health NOT_SERVING, new requests UNAVAILABLE) and "
        f"give the requests in flight this long to finish (default {DEFAULT_DRAIN_TIMEOUT_S:g})",
    )


def tls_config_from(args: argparse.Namespace) -> TLSConfig:
    return TLSConfig.from_env_and_args(args)


def api_keys_from(args: argparse.Namespace) -> tuple[str, ...]:
    return api_keys_from_env_and_args(args.api_key)


def advertise_host_from(args: argparse.Namespace) -> str:
    """The host this process's peers dial (``--advertise-host``, else from ``--host``)."""
    return advertise_host(args.host, args.advertise_host)


def server_fields_from(args: argparse.Namespace) -> dict:
    """The fields every server's config shares (addresses, ports, TLS, message size, drain)."""
    return {
        "host": args.host,
        "advertise_host": advertise_host_from(args),
        "port": args.port,
        "metrics_port": args.metrics_port,
        "tls": tls_config_from(args),
        "max_message_bytes": args.max_message_bytes,
        "drain_timeout_s": args.drain_timeout,
    }


def run_server(label: str, serve, config) -> int:
    """Serve ``config`` until SIGTERM/SIGINT, printing ``<label> listening on HOST:PORT``
    once ready (what ``dsmesh up`` and the launchers wait for)."""
    from dsmesh.runtime.grpc_server import run_until_signal

    def ready(port: int) -> None:
        print(f"{label} listening on {host_port(config.advertise_host, port)}", flush=True)

    run_until_signal(lambda stop: serve(config, stop, ready))
    return 0


def instance_fields_from(args: argparse.Namespace) -> dict:
    """The fields every prefill and decode config shares, from their common flags."""
    fields = server_fields_from(args)
    return {
        **fields,
        "broker_address": args.broker,
        "engine": engine_config_from(args),
        "transfer": transfer_config_from(args, fields["advertise_host"]),
        "instance_id": args.instance_id,
    }


def run_instance(role: str, serve, config, args: argparse.Namespace, deepep_mode: str) -> int:
    """Serve a prefill or decode instance until a signal: in this process, or as an
    expert-parallel group of rank processes (``--ep-size``; docs/EP.md)."""
    import dataclasses

    from dsmesh.runtime.grpc_server import run_until_signal

    def ready(instance_id: str, port: int) -> None:
        print(
            f"{role} {instance_id} listening on {host_port(config.advertise_host, port)}",
            flush=True,
        )

    ep = ep_config_from(args, deepep_mode=deepep_mode, advertised=config.advertise_host)
    if ep.ep_size > 1 or ep.num_redundant_experts:
        from dsmesh.instance.attach import new_instance_id
        from dsmesh.instance.ep_group import RankTarget, run_group

        config = dataclasses.replace(
            config, instance_id=config.instance_id or new_instance_id(role)
        )
        return run_group(
            ep,
            RankTarget(serve, config),
            ready,
            eplb_address=args.eplb,
            eplb_report_interval_s=args.eplb_report_interval,
        )
    if args.eplb:
        raise ValueError("--eplb needs an expert-parallel instance: --ep-size > 1")
    run_until_signal(lambda stop: serve(config, stop, ready))
    return 0
