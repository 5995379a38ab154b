"""What the sub-commands share: their flags come from the config fields
(dsmesh/options/fields.py); here the parsed flags become the configs, with the values that
are derived at start-up (the advertised host, TLS files from the environment, the engine's
``--tbo``, the rendezvous address of an expert-parallel group)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import TypeVar

from dsmesh.cli.server_flags import advertise_host_from, server_config_from
from dsmesh.engine.ep.runtime import EP_GROUP, EPConfig
from dsmesh.engine.options import EngineConfig
from dsmesh.instance.attach import ENGINE_GROUP, PDInstanceConfig, TransferConfig
from dsmesh.options.fields import add_options, from_args, given_flags, option_group
from dsmesh.runtime.address import LOOPBACK, ep_master_addr, host_port, interface_of, unbracket
from dsmesh.runtime.process_flags import add_gil_switch_arg, add_standby_arg

# the EP flags of ``dsmesh generate``, which runs one host's group and reports to no eplb_svc
OFFLINE_EP_OPTIONS = ("ep_size", "num_redundant_experts", "dispatch")

Config = TypeVar("Config")


def add_engine_args(
    p: argparse.ArgumentParser, *, not_given: bool = False, mem_fraction_help: str | None = None
) -> None:
    """The engine's flags: one per option field of :class:`EngineConfig` (its type, default
    and help; dsmesh/options/fields.py), and the process flag ``--gil-switch-ms``.
    ``not_given``: every flag defaults to None (``dsmesh up``, which forwards only the
    flags given)."""
    g = option_group(p, ENGINE_GROUP)
    add_options(g, EngineConfig, not_given=not_given)
    if mem_fraction_help is not None:
        for action in g._group_actions:
            if action.dest == "mem_fraction":
                action.help = mem_fraction_help
    add_gil_switch_arg(g, not_given)


def add_ep_args(p: argparse.ArgumentParser) -> None:
    """``dsmesh generate``'s expert-parallel flags (one host), with the engine's ``--tbo``."""
    g = option_group(p, EP_GROUP)
    add_options(g, EPConfig, only=OFFLINE_EP_OPTIONS)
    add_options(g, EngineConfig, only=("tbo",))


def add_instance_args(p: argparse.ArgumentParser, cls: type) -> None:
    """The flags of a prefill, decode or unified instance: ``cls``'s options (its engine's,
    transfer's and expert-parallel group's among them), the engine's ``--tbo`` for an
    instance that can be an expert-parallel group, ``--gil-switch-ms`` and ``--standby``."""
    add_options(p, cls)
    if issubclass(cls, PDInstanceConfig):
        add_options(option_group(p, EP_GROUP), EngineConfig, only=("tbo",))
    add_gil_switch_arg(option_group(p, ENGINE_GROUP))
    add_standby_arg(option_group(p, ENGINE_GROUP))


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


def ep_config_from(
    args: argparse.Namespace, deepep_mode: str = "normal", advertised: str = LOOPBACK
) -> EPConfig:
    """``advertised``: this process's advertised host; with ``--ep-nnodes`` > 1 it is node 0's
    rendezvous address by default, and its interface carries the group's gloo/NCCL traffic."""
    nnodes = getattr(args, "ep_nnodes", 1)
    node_rank = getattr(args, "ep_node_rank", 0)
    ep = from_args(
        EPConfig,
        args,
        deepep_mode=deepep_mode,
        master_addr=ep_master_addr(
            getattr(args, "ep_master_addr", ""), nnodes, node_rank, advertised
        ),
        socket_ifname=(interface_of(advertised) or "") if nnodes > 1 else "",
    )
    ep.validate()
    return ep


def transfer_config_from(args: argparse.Namespace, advertised: str) -> TransferConfig:
    """``advertised``: the process's advertised host, the transfer engine's by default."""
    return from_args(TransferConfig, args, hostname=unbracket(args.transfer_hostname) or advertised)


def instance_config_from(
    cls: type[Config], args: argparse.Namespace, deepep_mode: str = "normal"
) -> Config:
    """A prefill, decode or unified config from its parsed flags (:func:`add_instance_args`);
    ``deepep_mode``: the DeepEP mode of an expert-parallel group."""
    advertised = advertise_host_from(args)
    fixed: dict[str, object] = {"engine": engine_config_from(args)}
    if issubclass(cls, PDInstanceConfig):
        fixed["transfer"] = transfer_config_from(args, advertised)
        fixed["ep"] = ep_config_from(args, deepep_mode, advertised)
    return server_config_from(cls, args, **fixed)


def run_instance(role: str, serve, config) -> int:
    """Serve an instance until a signal: in this process, or, for a prefill or decode
    instance, as an expert-parallel group of rank processes (``--ep-size``; docs/EP.md)."""
    import dataclasses

    from dsmesh.runtime.grpc_server import run_until_signal

    def ready(instance_id: str, port: int) -> None:
        print(
            f"{role} {instance_id} listening on {host_port(config.advertise_host, port)}",
            flush=True,
        )

    ep = getattr(config, "ep", None)
    if ep is not None and (ep.ep_size > 1 or ep.num_redundant_experts):
        from dsmesh.instance.attach import new_instance_id
        from dsmesh.instance.ep_group import RankTarget, run_group

        config = dataclasses.replace(
            config, instance_id=config.instance_id or new_instance_id(role)
        )
        return run_group(
            ep,
            RankTarget(serve, config),
            ready,
            eplb_address=config.eplb_address,
            eplb_report_interval_s=config.eplb_report_interval_s,
        )
    if getattr(config, "eplb_address", ""):
        raise ValueError("--eplb needs an expert-parallel instance: --ep-size > 1")
    run_until_signal(lambda stop: serve(config, stop, ready))
    return 0
