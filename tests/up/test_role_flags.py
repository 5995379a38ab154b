"""`dsmesh up` forwards each bound/limit flag to exactly the services that own it, and every
forwarded flag exists on that service's command line (the flags come from the fields marked
``up`` in each service's config: dsmesh/cli/up.py ROLES)."""

from __future__ import annotations

from dsmesh.cli.main import build_parser
from dsmesh.cli.mesh_config import MeshConfig
from dsmesh.cli.stages import broker_stage, gateway_stage, instance_stage
from dsmesh.cli.up import ROLES, role_flags
from dsmesh.options.fields import up_fields

COMMAND = {
    "broker": ["kv-broker"],
    "eplb": ["eplb", "serve"],
    "ep": ["prefill", "--broker", "x:1"],
    "prefill": ["prefill", "--broker", "x:1"],
    "decode": ["decode", "--broker", "x:1"],
    "gateway": ["gateway", "--broker", "x:1"],
}


def test_bounds_reach_their_services() -> None:
    args = build_parser().parse_args(
        [
            "up",
            "--handoff-timeout",
            "7",
            "--liveness-grace",
            "3",
            "--release-quarantine",
            "4",
            "--max-inflight",
            "9",
            "--max-queued-tokens",
            "1000",
        ]
    )
    config = MeshConfig(
        broker_args=role_flags(args, "broker"),
        prefill_args=role_flags(args, "prefill"),
        decode_args=role_flags(args, "decode"),
        gateway_args=role_flags(args, "gateway"),
    )
    (broker,) = broker_stage(config, {})
    prefill, decode = instance_stage(config, {"kv-broker": "127.0.0.1:1"})
    (gateway,) = gateway_stage(config, {"kv-broker": "127.0.0.1:1"})
    assert broker.args[-2:] == ("--liveness-grace", "3.0")
    assert prefill.args[-2:] == ("--max-queued-tokens", "1000")
    assert decode.args[-4:] == ("--handoff-timeout", "7.0", "--release-quarantine", "4.0")
    assert gateway.args[-4:] == ("--handoff-timeout", "7.0", "--max-inflight", "9")


def test_unset_bounds_are_not_forwarded() -> None:
    args = build_parser().parse_args(["up"])
    assert all(role_flags(args, role.name) == () for role in ROLES)


def test_every_forwarded_flag_exists_on_its_service() -> None:
    parser = build_parser()
    for role in ROLES:
        for cls in role.configs:
            for field in up_fields(cls):
                if field.is_switch:
                    words, expected = [field.flag], True
                else:
                    value = {int: "1", float: "0.5"}.get(field.kind, "k1")
                    if field.meta.choices:  # a flag with choices takes one of them
                        value = str(field.meta.choices[-1])
                    words, expected = [field.flag, value], (field.meta.parse or field.kind)(value)
                parsed = parser.parse_args([*COMMAND[role.name], *words])
                got = getattr(parsed, field.dest)
                assert got == ([expected] if field.many else expected), (role.name, field.flag)
