"""Which address a process tells its peers to dial, as opposed to the one it binds.

A service binds ``--host`` and registers (with kv_broker), prints and hands to its transfer
engine and EP group its *advertised* host, ``--advertise-host``. Bound to one address, it
advertises that address; bound to every interface (``0.0.0.0``, ``::``), an address that
other hosts can reach is needed instead, and the default is the address of the interface
that the default route leaves by. The choices are pure functions; the only look-ups of the
machine's network (:func:`default_route_address`, :func:`interface_of`) are passed in or
called by the CLI once at start-up.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import socket
import struct
from collections.abc import Callable

WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::"})
LOOPBACK = "127.0.0.1"

RouteAddress = Callable[[socket.AddressFamily], "str | None"]


def unbracket(host: str) -> str:
    """``[::1]`` -> ``::1`` (the form URLs and gRPC targets use, accepted on input)."""
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def is_wildcard(host: str) -> bool:
    """True for a bind address that means every interface."""
    return unbracket(host) in WILDCARD_HOSTS


def host_port(host: str, port: int) -> str:
    """``host:port`` as gRPC targets and URLs write it: an IPv6 literal in brackets."""
    host = unbracket(host)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def advertise_host(
    bind_host: str, requested: str = "", route_address: RouteAddress | None = None
) -> str:
    """The host peers dial to reach a server bound to ``bind_host``.

    ``requested`` (``--advertise-host``) wins when given. Else a specific ``bind_host`` is
    its own answer. A wildcard one (``0.0.0.0``, ``::``, empty) takes
    ``route_address(family)``, by default :func:`default_route_address`: IPv4 for
    ``0.0.0.0`` and empty, IPv6 for ``::``. Raises ValueError when that finds none, or when
    ``requested`` is itself a wildcard, which no peer can dial.
    """
    if requested:
        if is_wildcard(requested):
            raise ValueError(f"--advertise-host must be an address peers can dial, got {requested}")
        return unbracket(requested)
    if not is_wildcard(bind_host):
        return unbracket(bind_host)
    family = socket.AF_INET6 if unbracket(bind_host) == "::" else socket.AF_INET
    found = (route_address or default_route_address)(family)
    if not found:
        raise ValueError(
            f"--host {bind_host or '(empty)'} binds every interface and this host has no "
            "default route to take an address from: pass --advertise-host"
        )
    return found


# Any address off every local network: asking the kernel for its route sends no packet.
_OFF_NETWORK = {socket.AF_INET: "8.8.8.8", socket.AF_INET6: "2001:4860:4860::8888"}


def default_route_address(family: socket.AddressFamily = socket.AF_INET) -> str | None:
    """The source address of the default route's interface (None without a default route).

    A UDP socket "connected" to an address off every local network makes the kernel pick the
    route and its source address; no packet is sent.
    """
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((_OFF_NETWORK[family], 9))
            return s.getsockname()[0]
    except OSError:  # ENETUNREACH: no default route (EAFNOSUPPORT: no IPv6 at all)
        return None


_SIOCGIFADDR = 0x8915


def interface_of(address: str) -> str | None:
    """The name of the local interface that holds IPv4 ``address`` (Linux), else None: what
    gloo and NCCL are told to use (``GLOO_SOCKET_IFNAME``, ``NCCL_SOCKET_IFNAME``)."""
    try:
        wanted = ipaddress.IPv4Address(unbracket(address))
    except ValueError:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            with contextlib.suppress(OSError):  # an interface without an IPv4 address
                packed = struct.pack("256s", name.encode()[:15])
                answer = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, packed)
                if ipaddress.IPv4Address(answer[20:24]) == wanted:
                    return name
    return None


def ep_master_addr(requested: str, nnodes: int, node_rank: int, advertised: str) -> str:
    """The address every rank of an EP group dials for its rendezvous (``--ep-master-addr``).

    Given, it wins. Else one host's group meets on loopback, and node 0 of a group that spans
    hosts offers its own advertised host; the other nodes must be told where node 0 is.
    """
    if requested:
        return unbracket(requested)
    if nnodes <= 1:
        return LOOPBACK
    if node_rank == 0:
        return advertised
    raise ValueError("--ep-master-addr is required on every node but node 0 (--ep-node-rank)")
