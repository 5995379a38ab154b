"""`dsmesh up` forwards each bound/limit flag to exactly the services that own it, and every
forwarded flag exists on that service's command line."""

from __future__ import annotations

from dsmesh.cli.main import build_parser
from dsmesh.cli.supervisor import MeshConfig, broker_stage, gateway_stage, instance_stage
from dsmesh.cli.up import ROLE_FLAGS, role_flags

COMMAND = {"broker": "kv-broker", "prefill": "prefill", "decode": "decode", "gateway": "gateway"}


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
    assert all(role_flags(args, role) == () for role in COMMAND)


def test_every_forwarded_flag_exists_on_its_service() -> None:
    parser = build_parser()
    for flag, roles, kind, _ in ROLE_FLAGS:
        for role in roles:
            extra = ["--broker", "x:1"] if role != "broker" else []
            value = "1" if kind is int else "1.5"
            parsed = parser.parse_args([COMMAND[role], *extra, flag, value])
            assert getattr(parsed, flag.lstrip("-").replace("-", "_")) == kind(value)
