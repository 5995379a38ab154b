"""Options declared once (dsmesh/options/fields.py): each EngineConfig field is the flag of
every engine command, what ``dsmesh up`` forwards, and a row of docs/OPTIONS.md; each service
config's field is a flag of its command (and, marked ``up``, of ``dsmesh up``, which forwards
it to that service), and a row of the service's table."""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path

import pytest

from dsmesh.cli import options_doc, up
from dsmesh.cli.common import instance_config_from, server_config_from
from dsmesh.cli.main import build_parser
from dsmesh.cli.mesh_config import MeshConfig
from dsmesh.cli.up import ROLES, Role, engine_flags, role_environment, role_flags, role_options
from dsmesh.decode_svc.service import DecodeConfig
from dsmesh.engine.options import EngineConfig
from dsmesh.eplb_svc.config import EPLBConfig
from dsmesh.gateway.config import GatewayConfig
from dsmesh.instance.attach import InstanceConfig
from dsmesh.kv_broker.config import BrokerConfig
from dsmesh.options.fields import (
    OptionField,
    add_options,
    all_option_fields,
    from_args,
    given_flags,
    option,
    option_fields,
    options_table,
    up_fields,
    up_flag,
)
from dsmesh.prefill_svc.service import PrefillConfig
from dsmesh.runtime.security import SecurityOptions
from dsmesh.unified_svc.service import UnifiedConfig

ROOT = Path(__file__).resolve().parents[2]
ENGINE_COMMANDS = ("generate", "prefill", "decode", "unified", "up")


def _subparser(*names: str) -> argparse.ArgumentParser:
    parser = build_parser()
    for name in names:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[name]
    return parser


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    return {s for a in parser._actions for s in a.option_strings}


@pytest.mark.parametrize("command", ENGINE_COMMANDS)
def test_every_engine_option_is_a_flag_of_every_engine_command(command: str) -> None:
    flags = _flags(_subparser(command))
    for field in option_fields(EngineConfig):
        if field.meta.cli:
            assert field.flag in flags, (command, field.flag)
            if field.is_switch:
                assert f"--no-{field.flag[2:]}" in flags


def test_engine_flags_parse_into_the_config() -> None:
    args = _subparser("unified").parse_args(
        ["--broker", "b:1", "--max-running-requests", "7", "--no-cuda-graphs", "--dtype",
         "bfloat16", "--speculative", "mtp"]
    )  # fmt: skip
    from dsmesh.cli.common import engine_config_from

    config = engine_config_from(args)
    assert config.max_running_requests == 7 and config.cuda_graphs is False
    assert config.dtype == "bfloat16" and config.speculative == "mtp"
    assert config.max_batch_tokens is None  # not given: derived at start-up


def test_up_forwards_exactly_the_engine_flags_given() -> None:
    up = _subparser("up")
    assert engine_flags(up.parse_args([])) == ()
    args = up.parse_args(
        ["--max-batch-tokens", "4096", "--no-prefix-cache", "--mem-fraction", "0.5",
         "--device", "cpu", "--gil-switch-ms", "1"]
    )  # fmt: skip
    # --mem-fraction and --device go through the supervisor, which places instances
    assert engine_flags(args) == (
        "--max-batch-tokens", "4096", "--no-prefix-cache", "--gil-switch-ms", "1.0",
    )  # fmt: skip


def test_removing_a_field_removes_its_flag_everywhere() -> None:
    """A config class built from the fields, less one: its flag, its forwarding and its docs
    row go with it, with nothing else to edit."""

    @dataclasses.dataclass(frozen=True)
    class Full:
        alpha: int = option(1, "alpha things")
        beta: bool = option(False, "beta switch")

    @dataclasses.dataclass(frozen=True)
    class Less:
        alpha: int = option(1, "alpha things")

    for cls, present in ((Full, True), (Less, False)):
        parser = argparse.ArgumentParser()
        add_options(parser, cls, not_given=True)
        assert ("--beta" in _flags(parser)) is present
        args = parser.parse_args(["--alpha", "3", *(["--beta"] if present else [])])
        assert given_flags(cls, args) == ("--alpha", "3", *(["--beta"] if present else []))
        assert ("`--beta`" in options_table(cls)) is present
        assert from_args(cls, args).alpha == 3


def test_docs_option_tables_are_generated_from_the_fields() -> None:
    text = (ROOT / "docs" / "OPTIONS.md").read_text()
    assert options_doc.config_table("engine options") == options_table(EngineConfig)
    for name, table in options_doc.TABLES.items():
        block = re.search(rf"<!-- {name}: begin -->\n(.*?)\n<!-- {name}: end -->", text, re.S)
        assert block is not None, f"docs/OPTIONS.md lost its '{name}' table markers"
        assert block.group(1) == table(), (
            f"docs/OPTIONS.md's {name} are out of date: python -m dsmesh.cli.options_doc"
        )


# ---- the services ---------------------------------------------------------------------------

# each command, the configs whose options are its flags, and the flags that are no field's
HELP = {"-h", "--help"}
SERVICE_COMMANDS: dict[tuple[str, ...], tuple[tuple[type, ...], set[str]]] = {
    ("kv-broker",): ((BrokerConfig,), HELP),
    ("eplb", "serve"): ((EPLBConfig,), HELP),
    ("gateway",): ((GatewayConfig,), HELP),
    # --gil-switch-ms (sys.setswitchinterval) and --standby (wait before the engine's build):
    # settings of the engine process, no config's
    ("prefill",): ((PrefillConfig,), HELP | {"--gil-switch-ms", "--standby"}),
    ("decode",): ((DecodeConfig,), HELP | {"--gil-switch-ms", "--standby"}),
    ("unified",): ((UnifiedConfig,), HELP | {"--gil-switch-ms", "--standby"}),
    ("up",): ((MeshConfig, EngineConfig), HELP | {"--gil-switch-ms"}),
    # the tool's inputs: which eplb_svc, which instance, where to write
    ("eplb", "dump"): ((SecurityOptions,), HELP | {"--eplb", "--instance", "--out"}),
}


def _spellings(field: OptionField, flag: str | None = None) -> set[str]:
    flag = flag or field.flag
    return {flag, f"--no-{flag[2:]}"} if field.is_switch else {flag}


def _expected_flags(command: tuple[str, ...], configs: tuple[type, ...]) -> set[str]:
    flags: set[str] = set()
    for cls in configs:
        for field, _ in all_option_fields(cls):
            if field.meta.cli:
                flags |= _spellings(field)
    if command in (("prefill",), ("decode",)):  # --tbo comes with the expert-parallel flags
        (tbo,) = (f for f in option_fields(EngineConfig) if f.name == "tbo")
        flags |= _spellings(tbo)
    if command == ("up",):
        for flag, (field, _, _) in role_options().items():
            flags |= _spellings(field, flag)
    return flags


def test_the_top_level_flags_are_no_fields() -> None:
    assert _flags(build_parser()) == HELP | {"--version", "--log-level"}


@pytest.mark.parametrize("command", list(SERVICE_COMMANDS), ids=" ".join)
def test_every_flag_of_a_service_is_a_field_and_every_field_a_flag(
    command: tuple[str, ...],
) -> None:
    configs, exceptions = SERVICE_COMMANDS[command]
    flags = _flags(_subparser(*command))
    expected = _expected_flags(command, configs)
    assert not expected & exceptions
    assert flags - exceptions == expected, command
    assert exceptions <= flags, command


def test_each_flag_lands_in_its_field() -> None:
    """A value given on the command line for each int or float option of a service's config
    (its own and those it inherits) is that field's value in the config built from the parsed
    flags; the nested expert-parallel group and the engine's --tbo too."""
    builders = {
        ("kv-broker",): lambda a: server_config_from(BrokerConfig, a),
        ("eplb", "serve"): lambda a: server_config_from(EPLBConfig, a),
        ("gateway", "--broker", "b:1"): lambda a: server_config_from(
            GatewayConfig, a, model_dir="m"
        ),
        ("prefill", "--broker", "b:1"): lambda a: instance_config_from(PrefillConfig, a),
        ("decode", "--broker", "b:1"): lambda a: instance_config_from(DecodeConfig, a),
        ("unified", "--broker", "b:1"): lambda a: instance_config_from(UnifiedConfig, a),
    }
    for argv, build in builders.items():
        config_cls = type(build(_subparser(argv[0]).parse_args(list(argv[1:]))))
        fields = [f for f in option_fields(config_cls) if f.kind in (int, float) and not f.optional]
        words: list[str] = []
        for f in fields:
            words += [f.flag, str(f.default + 1 if f.kind is int else f.default / 2)]
        parser = build_parser()
        config = build(parser.parse_args([*argv, *words]))
        for f in fields:
            want = f.default + 1 if f.kind is int else f.default / 2
            assert getattr(config, f.name) == want, (argv[0], f.flag)
    args = build_parser().parse_args(["prefill", "--broker", "b:1", "--ep-size", "2", "--tbo"])
    config = instance_config_from(PrefillConfig, args)
    assert config.engine.tbo and config.ep.ep_size == 2


def test_instances_share_the_instance_options() -> None:
    """prefill, decode and unified take ``InstanceConfig``'s options, declared once."""
    shared = {f.flag for f, _ in all_option_fields(InstanceConfig) if f.meta.cli}
    for command in ("prefill", "decode", "unified"):
        assert shared <= _flags(_subparser(command)), command


def _sample(field: OptionField) -> tuple[list[str], object]:
    """Command-line words that set ``field``, and the value they parse to."""
    if field.is_switch:
        return [], True
    text = {int: "3", float: "0.25"}.get(field.kind, "k1")
    if field.meta.choices:  # a flag with choices takes one of them
        text = str(field.meta.choices[-1])
    value = (field.meta.parse or field.kind)(text)
    return [text], (value,) if field.many else value


def test_up_forwards_exactly_the_role_flags_given() -> None:
    parser = _subparser("up")
    for flag, (field, _, _) in role_options().items():
        words, value = _sample(field)
        args = parser.parse_args([flag, *words])
        owners = {  # role -> its field that up offers as ``flag``
            r.name: f for r in ROLES for c in r.configs for f in up_fields(c) if up_flag(f) == flag
        }
        assert owners, flag
        for role in ROLES:
            forwarded = role_flags(args, role.name)
            own = owners.get(role.name)
            if own is None or field.meta.env:
                assert forwarded == (), (flag, role.name)
            elif field.is_switch:
                assert forwarded == (own.flag,), (flag, role.name)
            else:
                assert forwarded == (own.flag, str(value)), (flag, role.name)
        env = role_environment(args)
        assert env == ({field.meta.env: "k1"} if field.meta.env else {}), flag
    assert role_environment(parser.parse_args([])) == {}


def test_up_role_flags_land_in_the_mesh_config() -> None:
    args = _subparser("up").parse_args(["--eplb-interval", "5", "--tbo", "--max-queued", "3"])
    config = up.mesh_config_from(args)
    assert config.eplb_args == ("--interval", "5.0")
    assert config.ep_args == ("--tbo",)
    assert config.gateway_args == ("--max-queued", "3")
    assert {f"{r.name}_args" for r in ROLES} <= {f.name for f in dataclasses.fields(MeshConfig)}


def test_ups_role_options_come_from_the_metadata(monkeypatch: pytest.MonkeyPatch) -> None:
    """A service field marked ``up`` is a flag of ``dsmesh up`` in its role's group, and
    forwarded to that role; without the mark (or the field) it is neither."""

    @dataclasses.dataclass(frozen=True)
    class Full:
        alpha_s: float = option(1.0, "alpha seconds", up=True)
        beta: int = option(2, "beta count", up="--up-beta")
        gamma: bool = option(False, "gamma switch")

    @dataclasses.dataclass(frozen=True)
    class Less:
        alpha_s: float = option(1.0, "alpha seconds", up=True)
        gamma: bool = option(False, "gamma switch")

    for cls, present in ((Full, True), (Less, False)):
        monkeypatch.setattr(up, "ROLES", (Role("svc", (cls,), "svc group", "svc"),))
        parser = argparse.ArgumentParser()
        up.add_role_options(parser)
        groups = {
            a.title: {s for x in a._group_actions for s in x.option_strings}
            for a in parser._action_groups
        }
        assert groups["svc group"] == ({"--alpha", "--up-beta"} if present else {"--alpha"})
        assert "--gamma" not in _flags(parser)
        args = parser.parse_args(["--alpha", "4", *(["--up-beta", "5"] if present else [])])
        assert up.role_flags(args, "svc") == (
            "--alpha",
            "4.0",
            *(("--beta", "5") if present else ()),
        )
