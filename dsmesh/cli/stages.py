"""What ``dsmesh up`` runs: one builder per stage, given the mesh's config and the addresses
of the services started before it, by name ("kv-broker", "eplb"). Each returns the command
lines and environments of the stage's services (no process is started here)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from dsmesh.cli.mesh_config import (
    MeshConfig,
    engine_instances,
    instance_metrics_ports,
    mesh_placement,
)
from dsmesh.cli.placement import cuda_visible_devices
from dsmesh.runtime.address import LOOPBACK
from dsmesh.runtime.gpu_sharing import THREAD_PERCENTAGE_ENV
from dsmesh.runtime.lifecycle import DEFAULT_DRAIN_TIMEOUT_S
from dsmesh.runtime.security import DEFAULT_MAX_MESSAGE_BYTES


@dataclass(frozen=True)
class ServiceSpec:
    name: str  # unique per instance ("decode-1"); also the log file's name
    args: tuple[str, ...]  # dsmesh sub-command and flags
    pinned_port_flag: str | None = None  # after the first start, restarts reuse the port
    health_url: str | None = None  # HTTP health; None = gRPC health at the reported address
    env: dict[str, str] = field(default_factory=dict)  # over the supervisor's environment
    standby: bool = False  # keep a spare of the process, imported and waiting (--standby)


StageBuilder = Callable[[MeshConfig, dict[str, str]], list[ServiceSpec]]


def security_flags(config: MeshConfig) -> tuple[str, ...]:
    """TLS, message size and drain flags every child gets (API keys reach the gateway
    through its environment, out of the process list)."""
    size = config.max_message_bytes
    limit = ("--max-message-bytes", str(size)) if size != DEFAULT_MAX_MESSAGE_BYTES else ()
    drain = config.drain_timeout_s
    drain_flag = ("--drain-timeout", f"{drain:g}") if drain != DEFAULT_DRAIN_TIMEOUT_S else ()
    return (*config.tls.to_args(), *limit, *drain_flag)


def fraction_arg(fraction: float) -> str:
    """``fraction`` rounded down to 4 decimals: the shares of one GPU never add up to more
    than its total."""
    return f"{math.floor(fraction * 10_000) / 10_000:g}"


def no_gpu_env(config: MeshConfig) -> dict[str, str]:
    """The environment of a service that runs no engine: on a CUDA mesh it sees no GPU, so
    that it cannot take memory on one by accident."""
    return {"CUDA_VISIBLE_DEVICES": ""} if mesh_placement(config) is not None else {}


def broker_stage(config: MeshConfig, addresses: dict[str, str]) -> list[ServiceSpec]:
    args = ("kv-broker", "--host", LOOPBACK, "--port", "0", *security_flags(config))
    args += config.broker_args
    return [ServiceSpec("kv-broker", args, pinned_port_flag="--port", env=no_gpu_env(config))]


def eplb_stage(config: MeshConfig, addresses: dict[str, str]) -> list[ServiceSpec]:
    if not config.eplb:
        return []
    args = ("eplb", "serve", "--host", LOOPBACK, "--port", "0", *security_flags(config))
    args += config.eplb_args
    return [ServiceSpec("eplb", args, pinned_port_flag="--port", env=no_gpu_env(config))]


def instance_stage(config: MeshConfig, addresses: dict[str, str]) -> list[ServiceSpec]:
    """Every prefill, decode and unified instance: the forwarded engine flags, and on a CUDA
    mesh ``--device cuda``, its GPUs first in ``CUDA_VISIBLE_DEVICES`` and its
    ``--mem-fraction``."""
    placement = mesh_placement(config)
    model = ("--model", config.model) if config.model else ()
    ep = ("--ep-size", str(config.ep_size)) if config.ep_size is not None else ()
    ep += config.ep_args
    ep += ("--eplb", addresses["eplb"]) if "eplb" in addresses else ()
    own = {"prefill": (*ep, *config.prefill_args), "decode": (*ep, *config.decode_args)}
    specs = []
    metrics_ports = instance_metrics_ports(config)
    for inst in engine_instances(config):
        args = (inst.role, "--broker", addresses["kv-broker"], "--host", LOOPBACK, "--port", "0")
        args += (*security_flags(config), *model, *config.engine_args)
        if inst.name in metrics_ports:
            args += ("--metrics-port", str(metrics_ports[inst.name]))
        env: dict[str, str] = {}
        if placement is not None:
            fraction = placement.mem_fraction(inst.name, config.mem_fraction)
            args += ("--device", "cuda", "--mem-fraction", fraction_arg(fraction))
            gpu_ids = placement.gpu_ids[inst.name]
            env["CUDA_VISIBLE_DEVICES"] = cuda_visible_devices(gpu_ids, config.visible_gpus or ())
            env.update(config.mps_env)
            if config.mps_env and inst.role == "decode" and config.decode_sm_percent is not None:
                env[THREAD_PERCENTAGE_ENV] = str(config.decode_sm_percent)
        elif config.device is not None:
            args += ("--device", config.device)
        args += own.get(inst.role, ())
        specs.append(ServiceSpec(inst.name, args, env=env, standby=config.spares))
    return specs


def gateway_stage(config: MeshConfig, addresses: dict[str, str]) -> list[ServiceSpec]:
    if not config.gateway:
        return []
    args = (
        "gateway",
        "--broker",
        addresses["kv-broker"],
        "--host",
        config.host,
        "--grpc-port",
        str(config.grpc_port),
        "--http-port",
        str(config.http_port),
        *(("--model", config.model) if config.model else ()),
        *security_flags(config),
        *config.gateway_args,
    )
    health = f"http://{_probe_host(config.host)}:{config.http_port}/health"
    env = no_gpu_env(config)
    return [ServiceSpec("gateway", args, "--grpc-port", health_url=health, env=env)]


def url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _probe_host(host: str) -> str:
    """Where to reach a service bound to ``host`` from this machine, as a URL's host."""
    if host in ("", "0.0.0.0"):
        return LOOPBACK
    if host == "::":
        return "[::1]"
    return url_host(host)


STAGES: tuple[StageBuilder, ...] = (broker_stage, eplb_stage, instance_stage, gateway_stage)
