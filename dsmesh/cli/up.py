"""``dsmesh up``: the whole mesh on this machine with one command, supervised.

Its flags come from fields (dsmesh/options/fields.py): :class:`MeshConfig`'s own, the
engine's (forwarded to every engine instance when given), and the service options marked
``up`` in each role's config (:data:`ROLES`), forwarded when given to the services of that
role; the API keys among them go through the environment, out of the process list.
"""

from __future__ import annotations

import argparse
import os
from typing import NamedTuple

from dsmesh.cli.common import add_engine_args, engine_flags_given
from dsmesh.cli.mesh_config import MeshConfig
from dsmesh.cli.server_flags import tls_config_from
from dsmesh.decode_svc.service import DecodeConfig
from dsmesh.engine.ep.runtime import EP_GROUP, EPConfig
from dsmesh.engine.kv.budget import DEFAULT_MEM_FRACTION
from dsmesh.engine.options import EngineConfig
from dsmesh.eplb_svc.config import EPLBConfig
from dsmesh.gateway.config import GatewayConfig
from dsmesh.kv_broker.config import BrokerConfig
from dsmesh.options.fields import (
    OptionField,
    add_flag,
    add_options,
    from_args,
    option_group,
    spell,
    up_fields,
    up_flag,
)
from dsmesh.prefill_svc.service import PrefillConfig

BOUNDS = "bounds and limits (forwarded to the services that own them; default: theirs)"


class Role(NamedTuple):
    """Services ``up`` starts that take the same forwarded options: ``MeshConfig``'s
    ``<name>_args`` holds them, spelled for their command line."""

    name: str
    configs: tuple[type, ...]  # whose fields marked ``up`` up offers
    group: str  # the help group of those flags in ``up``
    services: str  # who gets them, as the help says


ROLES = (
    Role("broker", (BrokerConfig,), BOUNDS, "kv-broker"),
    Role("eplb", (EPLBConfig,), EP_GROUP, "eplb"),
    Role("ep", (EPConfig, EngineConfig), EP_GROUP, "prefill, decode"),  # as EP groups
    Role("prefill", (PrefillConfig,), BOUNDS, "prefill"),
    Role("decode", (DecodeConfig,), BOUNDS, "decode"),
    Role("gateway", (GatewayConfig,), BOUNDS, "gateway"),
)


def configure(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Start kv_broker, the prefill, decode and unified instances and the "
        "gateway as separate processes, wait until all are healthy, print where to reach the "
        "mesh, restart any that dies (with backoff) and stop them all on Ctrl-C or SIGTERM. "
        "On GPUs each instance gets its own GPUs and its share of their memory (docs/DEPLOY.md)."
    )
    add_options(p, MeshConfig)
    add_role_options(p)
    # Not given: None, and the service's own default (or derived value) applies. Only the
    # flags given are forwarded to the engine instances (dsmesh/options/fields.py).
    add_engine_args(
        p,
        not_given=True,
        mem_fraction_help="fraction of each GPU's memory for the weights + KV pools of the "
        "processes on it, split evenly between them (each gets --mem-fraction F/k); the rest "
        f"is left for activations and CUDA graphs (default {DEFAULT_MEM_FRACTION})",
    )
    p.set_defaults(func=run)


def role_options() -> dict[str, tuple[OptionField, tuple[str, ...], str]]:
    """Every service option ``up`` offers, by its flag in ``up``: the first field that
    declares it, the services it is forwarded to, its help group."""
    out: dict[str, tuple[OptionField, tuple[str, ...], str]] = {}
    for role in ROLES:
        for cls in role.configs:
            for field in up_fields(cls):
                flag = up_flag(field)
                first, roles, group = out.get(flag, (field, (), field.meta.group or role.group))
                out[flag] = (first, (*roles, role.services), group)
    return out


def add_role_options(p: argparse.ArgumentParser) -> None:
    """A flag for each option of :func:`role_options`, defaulting to None (not forwarded)."""
    for flag, (field, roles, group) in role_options().items():
        text = f"{field.meta.help} ({', '.join(roles)})"
        add_flag(option_group(p, group), field, None, not_given=True, flag=flag, help=text)


def _given(args: argparse.Namespace, role: Role):
    for cls in role.configs:
        for field in up_fields(cls):
            yield field, getattr(args, up_flag(field)[2:].replace("-", "_"), None)


def role_flags(args: argparse.Namespace, role: str) -> tuple[str, ...]:
    """The service options given to ``up`` that belong to ``role``'s command line, spelled
    as that command takes them (those with an environment variable go through it)."""
    (match,) = (r for r in ROLES if r.name == role)
    return tuple(
        word for field, value in _given(args, match) if not field.meta.env
        for word in spell(field, value)
    )  # fmt: skip


def role_environment(args: argparse.Namespace) -> dict[str, str]:
    """The service options given to ``up`` that reach the services through their
    environment variable (API keys: every local user can read the process list)."""
    return {
        field.meta.env: ",".join(map(str, value))
        for role in ROLES
        for field, value in _given(args, role)
        if field.meta.env and value
    }


def engine_flags(args: argparse.Namespace) -> tuple[str, ...]:
    """The engine flags given to ``up``, spelled for ``dsmesh prefill``/``decode``/``unified``
    (``--device`` and ``--mem-fraction`` go through the supervisor, which places instances
    on GPUs; ``--model`` goes to every service)."""
    return engine_flags_given(args)


def run(args: argparse.Namespace) -> int:
    from dsmesh.cli.supervisor import run_mesh

    config = mesh_config_from(args)
    # to the children through the environment they inherit, not their command lines
    os.environ.update(role_environment(args))
    return run_mesh(config)


def mesh_config_from(args: argparse.Namespace) -> MeshConfig:
    """``up``'s flags as the supervisor's config (the one place they map onto it)."""
    log_level = getattr(args, "log_level", "WARNING")
    return from_args(
        MeshConfig,
        args,
        model=args.model,
        device=args.device,
        mem_fraction=args.mem_fraction if args.mem_fraction is not None else DEFAULT_MEM_FRACTION,
        engine_args=engine_flags(args),
        tls=tls_config_from(args),
        log_level=None if log_level.upper() == "WARNING" else log_level,
        **{f"{role.name}_args": role_flags(args, role.name) for role in ROLES},
    )
