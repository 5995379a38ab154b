"""TLSConfig, API key parsing and `dsmesh up` forwarding, without processes."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from dsmesh.cli.common import advertise_host_from, transfer_config_from
from dsmesh.cli.main import build_parser
from dsmesh.cli.mesh_config import MeshConfig
from dsmesh.cli.stages import broker_stage, gateway_stage, instance_stage
from dsmesh.gateway.config import GatewayConfig
from dsmesh.options.fields import from_args
from dsmesh.runtime.security import TLSConfig, bearer_matches
from tests.security.certs import Pki


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["kv-broker", *argv])


def test_off_by_default() -> None:
    config = TLSConfig.from_env_and_args(parse(), env={})
    assert config == TLSConfig()
    assert not config.enabled
    assert config.to_args() == ()


def test_env_fallback_and_flags_win(pki: Pki) -> None:
    env = {
        "DSMESH_TLS_CERT": str(pki.service.cert),
        "DSMESH_TLS_KEY": str(pki.service.key),
        "DSMESH_TLS_CA": str(pki.ca),
        "DSMESH_TLS_CLIENT_AUTH": "1",
    }
    from_env = TLSConfig.from_env_and_args(parse(), env=env)
    assert from_env == TLSConfig(
        str(pki.service.cert), str(pki.service.key), str(pki.ca), client_auth=True
    )
    flags = parse("--tls-cert", str(pki.client.cert), "--tls-key", str(pki.client.key))
    mixed = TLSConfig.from_env_and_args(flags, env={**env, "DSMESH_TLS_CLIENT_AUTH": "true"})
    assert (mixed.cert_file, mixed.key_file) == (str(pki.client.cert), str(pki.client.key))
    assert (mixed.ca_file, mixed.client_auth) == (str(pki.ca), True)
    no_auth = TLSConfig.from_env_and_args(parse("--no-tls-client-auth"), env=env)
    assert not no_auth.client_auth


def test_to_args_round_trips(pki: Pki) -> None:
    config = TLSConfig(
        str(pki.service.cert), str(pki.service.key), str(pki.ca), True, server_name="localhost"
    )
    assert TLSConfig.from_env_and_args(parse(*config.to_args()), env={}) == config


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"cert_file": "c.pem"}, "go together"),
        ({"key_file": "k.pem"}, "go together"),
        ({"cert_file": "c", "key_file": "k", "client_auth": True}, "--tls-client-auth needs"),
        ({"ca_file": "ca", "client_auth": True}, "--tls-client-auth needs"),
        ({"server_name": "x"}, "needs TLS"),
    ],
)
def test_inconsistent_configs_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TLSConfig(**kwargs)


def test_missing_file_is_named(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.pem")
    with pytest.raises(FileNotFoundError, match="--tls-ca .*nope.pem"):
        TLSConfig.from_env_and_args(parse(), env={"DSMESH_TLS_CA": missing})


def test_bad_boolean_env_is_refused() -> None:
    with pytest.raises(ValueError, match="DSMESH_TLS_CLIENT_AUTH"):
        TLSConfig.from_env_and_args(parse(), env={"DSMESH_TLS_CLIENT_AUTH": "maybe"})


def test_client_only_config_cannot_serve(pki: Pki) -> None:
    with pytest.raises(ValueError, match="--tls-cert and --tls-key"):
        TLSConfig(ca_file=str(pki.ca)).server_credentials()
    assert TLSConfig(ca_file=str(pki.ca)).channel_credentials() is not None


def _api_keys(*argv: str, env: dict[str, str]) -> tuple[str, ...]:
    """The gateway's API keys for ``argv`` (its --api-key flags) and environment ``env``."""
    args = build_parser().parse_args(["gateway", "--broker", "b:1", *argv])
    return from_args(GatewayConfig, args, env=env, model_dir="m").api_keys


def test_api_keys() -> None:
    assert _api_keys(env={}) == ()
    assert _api_keys(env={"DSMESH_API_KEYS": " a, b ,,"}) == ("a", "b")
    assert _api_keys("--api-key", "x", env={"DSMESH_API_KEYS": "a"}) == ("x",)
    assert _api_keys("--api-key", " x ", "--api-key", "y", env={}) == ("x", "y")
    with pytest.raises(ValueError, match="DSMESH_API_KEYS: .*spaces"):
        _api_keys(env={"DSMESH_API_KEYS": "a b"})
    with pytest.raises(SystemExit):  # the parser refuses it, naming --api-key
        _api_keys("--api-key", "a b", env={})


def test_bearer_matches() -> None:
    keys = ("k1", "k2")
    assert bearer_matches("Bearer k1", keys)
    assert bearer_matches("bearer k2", keys)
    assert not bearer_matches(None, keys)
    assert not bearer_matches("", keys)
    assert not bearer_matches("k1", keys)
    assert not bearer_matches("Basic k1", keys)
    assert not bearer_matches("Bearer k", keys)
    assert not bearer_matches("Bearer k1x", keys)
    assert not bearer_matches("Bearer ", keys)
    assert not bearer_matches("Bearer ké", keys)  # non-ASCII: no match, no exception


def test_up_forwards_tls_to_every_child(pki: Pki) -> None:
    tls = TLSConfig(str(pki.service.cert), str(pki.service.key), str(pki.ca), True)
    config = MeshConfig(tls=tls, max_message_bytes=1 << 20)
    flags = (*tls.to_args(), "--max-message-bytes", str(1 << 20))
    specs = [
        *broker_stage(config, {}),
        *instance_stage(config, {"kv-broker": "127.0.0.1:1"}),
        *gateway_stage(config, {"kv-broker": "127.0.0.1:1"}),
    ]
    assert [s.name for s in specs] == ["kv-broker", "prefill-0", "decode-0", "gateway"]
    for spec in specs:
        assert "--tls-client-auth" in spec.args, spec.name
        joined = " ".join(spec.args)
        assert " ".join(flags) in joined, spec.name
        assert "--api-key" not in spec.args  # keys go through the environment


def test_up_adds_nothing_by_default() -> None:
    for spec in broker_stage(MeshConfig(), ""):
        assert not any(arg.startswith(("--tls", "--max-message")) for arg in spec.args)


@pytest.mark.parametrize(
    "argv",
    [
        ["kv-broker"],
        ["prefill", "--broker", "b:1"],
        ["decode", "--broker", "b:1"],
        ["gateway", "--broker", "b:1"],
        ["up"],
    ],
)
def test_services_bind_loopback_by_default(argv: list[str]) -> None:
    args = build_parser().parse_args(argv)
    assert args.host == "127.0.0.1"
    if hasattr(args, "advertise_host"):
        assert advertise_host_from(args) == "127.0.0.1"
    if hasattr(args, "transfer_hostname"):
        assert transfer_config_from(args, advertise_host_from(args)).hostname == "127.0.0.1"
