"""dsmesh/runtime/tcp_timeout.py on real loopback sockets: it finds this process's TCP
sockets by inode and remote address, and sets TCP_USER_TIMEOUT and keepalive on those that
have no user timeout, through duplicates of their descriptors, leaving a socket's own timeout
alone."""

from __future__ import annotations

import os
import socket
import sys

import pytest

from dsmesh.runtime.tcp_timeout import set_peer_timeout, socket_inodes, tcp_inodes_to

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="reads /proc and sets a Linux socket option"
)


def _inode(sock: socket.socket) -> int:
    return int(os.readlink(f"/proc/self/fd/{sock.fileno()}")[8:-1])


def _user_timeout(sock: socket.socket) -> int:
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT)


def _keepalive(sock: socket.socket) -> tuple[int, int, int]:
    return (
        sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE),
        sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE),
        sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL),
    )


def test_only_the_new_sockets_without_a_timeout_get_one() -> None:
    before = socket_inodes()
    with socket.create_server(("127.0.0.1", 0)) as server:
        owned = socket.socket()
        owned.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, 1234)
        with socket.create_connection(server.getsockname()) as plain, owned:
            owned.connect(server.getsockname())
            accepted, _ = server.accept()
            with accepted:
                new = socket_inodes() - before
                assert {_inode(s) for s in (server, plain, owned, accepted)} <= new
                assert _inode(plain) in tcp_inodes_to(frozenset({"127.0.0.1"}))
                assert _inode(plain) not in tcp_inodes_to(frozenset({"198.18.0.9"}))
                # the listener, the plain client and the accepted end; not the owned one
                assert set_peer_timeout(new, 4000) == 3
                assert [_user_timeout(s) for s in (plain, accepted)] == [4000, 4000]
                assert [_keepalive(s) for s in (plain, accepted)] == [(1, 1, 1)] * 2
                assert _user_timeout(owned) == 1234
                assert _keepalive(owned)[0] == 0
                assert set_peer_timeout(new, 4000) == 0  # set already
                plain.sendall(b"still a working socket")
                assert accepted.recv(100) == b"still a working socket"
