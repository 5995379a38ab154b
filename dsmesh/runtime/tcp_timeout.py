"""A bound on a silent peer for sockets that libraries opened in this process (Mooncake's
transfer engine, gloo's pairs), which offer no option for it: ``TCP_USER_TIMEOUT``, with
keepalive probes every second while the connection is idle.

The kernel aborts a TCP connection whose data (or SYN) stays unacknowledged for its user
timeout, and, with keepalive on, one whose probes go unanswered that long: the call waiting
on it fails with ETIMEDOUT, whether it was sending or waiting to receive, and nothing the
connection held is sent any more, even once the socket is closed. Without it, a peer whose
host went dark (its link down, no RST) keeps a blocked send waiting for the kernel's
retransmissions, about 15 minutes, a blocked receive for ever, and a closed socket's data is
still delivered if the link comes back.

The sockets are found through ``/proc/self/fd`` (their inodes) and, for their remote
addresses, ``/proc/self/net/tcp{,6}``; the option is set on a duplicate of each descriptor.
Sockets that have a user timeout already (gRPC sets its own) keep it. A descriptor closed and
reused meanwhile is at worst another TCP socket given the bound. Linux only: elsewhere these
functions find no socket.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket


def socket_inodes() -> set[int]:
    """The inodes of this process's sockets (any kind)."""
    inodes: set[int] = set()
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/self/fd/{name}")
                if target.startswith("socket:["):
                    inodes.add(int(target[8:-1]))
    return inodes


def _remote_ip(hex_address: str) -> str:
    """``/proc/net/tcp{,6}``'s ``rem_address`` (hex, host-order 32-bit words) as an IP string;
    an IPv4-mapped IPv6 address as its IPv4 form."""
    raw = bytes.fromhex(hex_address.split(":")[0])
    raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    address = ipaddress.ip_address(raw)
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return str(address.ipv4_mapped)
    return str(address)


def tcp_remote_ips() -> dict[int, str]:
    """Socket inode -> remote IP of this network namespace's TCP sockets, in any state
    (connecting included; a listener's is the unspecified address)."""
    remote: dict[int, str] = {}
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as f:
            next(f, None)  # the header
            for line in f:
                fields = line.split()
                if len(fields) > 9:
                    remote[int(fields[9])] = _remote_ip(fields[2])
    return remote


def tcp_inodes_to(addresses: frozenset[str]) -> set[int]:
    """Inodes of the TCP sockets whose remote end is one of ``addresses``."""
    return {inode for inode, ip in tcp_remote_ips().items() if ip in addresses}


def set_peer_timeout(inodes: set[int], user_timeout_ms: int) -> int:
    """Give this process's TCP sockets among ``inodes`` that have no user timeout yet
    ``user_timeout_ms``, and keepalive probes after a second idle, every second; how many it
    set."""
    if not inodes or not hasattr(socket, "TCP_USER_TIMEOUT"):
        return 0
    tcp = inodes & tcp_remote_ips().keys()
    if not tcp:
        return 0
    count = 0
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc/self/fd"):
            try:
                target = os.readlink(f"/proc/self/fd/{name}")
                if not target.startswith("socket:[") or int(target[8:-1]) not in tcp:
                    continue
                sock = socket.socket(fileno=os.dup(int(name)))
            except (OSError, ValueError):
                continue
            with sock, contextlib.suppress(OSError):
                if sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 0:
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, user_timeout_ms)
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 1)
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 1)
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
                    count += 1
    return count
