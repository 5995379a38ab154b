"""What a process advertises to its peers (dsmesh/runtime/address.py), and how the CLI maps
``--host``, ``--advertise-host``, ``--transfer-hostname`` and ``--ep-master-addr`` onto it."""

from __future__ import annotations

import socket

import pytest

from dsmesh.cli.common import (
    advertise_host_from,
    ep_config_from,
    instance_config_from,
    server_config_from,
)
from dsmesh.cli.main import build_parser
from dsmesh.decode_svc.service import DecodeConfig
from dsmesh.kv_broker.config import BrokerConfig
from dsmesh.runtime.address import (
    advertise_host,
    default_route_address,
    ep_master_addr,
    host_port,
    interface_of,
    is_wildcard,
)


def _routes(v4: str | None = "198.18.0.5", v6: str | None = "2001:db8::5"):
    asked: list[socket.AddressFamily] = []

    def route(family: socket.AddressFamily) -> str | None:
        asked.append(family)
        return v4 if family == socket.AF_INET else v6

    return route, asked


def test_a_specific_bind_address_is_advertised_as_it_is() -> None:
    route, asked = _routes()
    assert advertise_host("10.1.2.3", route_address=route) == "10.1.2.3"
    assert advertise_host("decode-0.decode", route_address=route) == "decode-0.decode"
    assert advertise_host("[fd00::7]", route_address=route) == "fd00::7"
    assert asked == []  # no look-up when the answer is known


@pytest.mark.parametrize(
    ("bind", "family", "expected"),
    [
        ("0.0.0.0", socket.AF_INET, "198.18.0.5"),
        ("", socket.AF_INET, "198.18.0.5"),
        ("::", socket.AF_INET6, "2001:db8::5"),
        ("[::]", socket.AF_INET6, "2001:db8::5"),
    ],
)
def test_a_wildcard_bind_advertises_the_default_routes_address(
    bind: str, family: socket.AddressFamily, expected: str
) -> None:
    route, asked = _routes()
    assert advertise_host(bind, route_address=route) == expected
    assert asked == [family]


def test_an_explicit_advertise_host_wins() -> None:
    route, asked = _routes()
    assert advertise_host("0.0.0.0", "198.18.0.9", route) == "198.18.0.9"
    assert advertise_host("127.0.0.1", "gw.example", route) == "gw.example"
    assert advertise_host("::", "[fd00::9]", route) == "fd00::9"
    assert asked == []


def test_no_default_route_and_a_wildcard_advertise_host_are_errors() -> None:
    route, _ = _routes(v4=None)
    with pytest.raises(ValueError, match="--advertise-host"):
        advertise_host("0.0.0.0", route_address=route)
    with pytest.raises(ValueError, match="peers can dial"):
        advertise_host("127.0.0.1", "0.0.0.0", route)


def test_host_port_brackets_ipv6() -> None:
    assert host_port("198.18.0.2", 50054) == "198.18.0.2:50054"
    assert host_port("fd00::2", 50054) == "[fd00::2]:50054"
    assert host_port("[fd00::2]", 1) == "[fd00::2]:1"
    assert host_port("kv-broker", 50054) == "kv-broker:50054"
    assert is_wildcard("0.0.0.0") and is_wildcard("[::]") and not is_wildcard("127.0.0.1")


def test_ep_master_addr() -> None:
    assert ep_master_addr("", 1, 0, "198.18.0.3") == "127.0.0.1"  # one host: loopback
    assert ep_master_addr("", 2, 0, "198.18.0.3") == "198.18.0.3"  # node 0 offers itself
    assert ep_master_addr("198.18.0.3", 2, 1, "198.18.0.4") == "198.18.0.3"
    with pytest.raises(ValueError, match="--ep-master-addr is required"):
        ep_master_addr("", 2, 1, "198.18.0.4")


def test_this_machines_default_route_address_is_its_own() -> None:
    found = default_route_address(socket.AF_INET)
    if found is None:
        pytest.skip("this machine has no IPv4 default route")
    with socket.socket() as s:
        s.bind((found, 0))  # only a local address binds
    assert interface_of(found) in {name for _, name in socket.if_nameindex()}


def test_interface_of() -> None:
    assert interface_of("127.0.0.1") == "lo"
    assert interface_of("not-an-address") is None
    assert interface_of("::1") is None  # IPv4 only


# ---- the CLI --------------------------------------------------------------------------------


def _parse(*argv: str):
    return build_parser().parse_args(list(argv))


@pytest.mark.parametrize(
    "argv",
    [
        ["kv-broker"],
        ["eplb", "serve"],
        ["gateway", "--broker", "b:1"],
        ["prefill", "--broker", "b:1"],
        ["decode", "--broker", "b:1"],
        ["unified", "--broker", "b:1"],
    ],
)
def test_every_service_takes_host_and_advertise_host(argv: list[str]) -> None:
    args = _parse(*argv, "--host", "0.0.0.0", "--advertise-host", "198.18.0.7")
    assert (args.host, advertise_host_from(args)) == ("0.0.0.0", "198.18.0.7")
    assert advertise_host_from(_parse(*argv, "--host", "198.18.0.8")) == "198.18.0.8"


def test_server_configs_carry_both_addresses() -> None:
    args = _parse("kv-broker", "--host", "0.0.0.0", "--advertise-host", "h1")
    config = server_config_from(BrokerConfig, args)
    assert (config.host, config.advertise_host) == ("0.0.0.0", "h1")


def test_the_transfer_engine_follows_the_advertised_host() -> None:
    base = ("decode", "--broker", "b:1", "--host", "0.0.0.0", "--advertise-host", "198.18.0.7")
    assert instance_config_from(DecodeConfig, _parse(*base)).transfer.hostname == "198.18.0.7"
    own = _parse(*base, "--transfer-hostname", "198.19.0.7")
    assert instance_config_from(DecodeConfig, own).transfer.hostname == "198.19.0.7"


def test_ep_master_follows_node_0s_advertised_host() -> None:
    base = ("prefill", "--broker", "b:1", "--ep-size", "2", "--ep-nnodes", "2")
    node0 = _parse(*base, "--ep-master-port", "29500", "--advertise-host", "127.0.0.1")
    ep = ep_config_from(node0, advertised="127.0.0.1")
    assert (ep.master_addr, ep.socket_ifname) == ("127.0.0.1", "lo")
    node1 = _parse(*base, "--ep-node-rank", "1", "--ep-master-port", "29500")
    with pytest.raises(ValueError, match="--ep-master-addr is required"):
        ep_config_from(node1, advertised="127.0.0.1")
    alone = ep_config_from(_parse("prefill", "--broker", "b:1", "--ep-size", "2"))
    assert (alone.master_addr, alone.socket_ifname) == ("127.0.0.1", "")
