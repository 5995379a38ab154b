"""A KV write stalled on a peer that stopped answering (its host went dark): give it up within
a bound, and make sure none of its bytes land afterwards.

What Mooncake's TCP transport does on its own (0.3.13, seen on network namespaces):

- A write that makes no progress is given up after ``MC_TCP_PROGRESS_TIMEOUT_SEC`` (default
  30 s), and its socket closed. Closing does not drop what the kernel holds for the socket:
  it keeps retransmitting (``tcp_orphan_retries``, about 100 s), so when the peer's link comes
  back the write lands, into pages the peer may have handed to another request by then.
- A failed call returns at its first failed segment; the call's other segments stay queued
  for the peer, and the engine opens a new connection for them at once. Once the link is back,
  that connection completes and they land too.

A socket with ``TCP_USER_TIMEOUT`` is aborted by the kernel instead, once its data (or its SYN)
stays unacknowledged that long: an aborted connection sends nothing more, and a connection that
could not be opened fails the segments queued for it. Mooncake has no option for it, so
:class:`StallGuard` sets it on the engine's sockets itself (dsmesh/runtime/tcp_timeout.py): a
write still in flight after ``check_after_s`` has every TCP socket of this process to the
write's peer (connecting ones included) that has no user timeout yet given
``user_timeout_s``, and keepalive probes while idle (gRPC's sockets carry their own, and keep
them). The kernel then fails the write ``user_timeout_s`` after its bytes were sent (or, its
bytes acknowledged and the acknowledgement frame awaited, after the peer last answered).

When a write that stalled fails, :meth:`StallGuard.quiesce` keeps bounding the peer's sockets
for another ``user_timeout_s`` and a second: by then the engine's re-connection for the call's
other segments has failed too, or (the link back meanwhile) they have landed. Once the failed
call has returned, nothing of it is on its way any more.

Linux only (``/proc``); elsewhere the guard does nothing.
"""

from __future__ import annotations

import contextlib
import ipaddress
import itertools
import logging
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

from dsmesh.runtime.tcp_timeout import set_peer_timeout, tcp_inodes_to

log = logging.getLogger(__name__)
QUIESCE_MARGIN_S = 1.0  # beyond the user timeout: the engine's reconnect and our sweep period


def peer_addresses(host: str) -> frozenset[str]:
    """The IP addresses ``host`` (a name or an address, IPv6 with or without brackets)
    resolves to; empty when it does not resolve."""
    host = host.strip("[]")
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError:
        return frozenset()
    return frozenset(str(ipaddress.ip_address(info[4][0])) for info in infos)


def bound_sockets_to(addresses: frozenset[str], user_timeout_ms: int) -> int:
    """``TCP_USER_TIMEOUT`` and keepalive on this process's TCP sockets to ``addresses`` that
    have no user timeout; how many it set."""
    if not addresses:
        return 0
    return set_peer_timeout(tcp_inodes_to(addresses), user_timeout_ms)


@dataclass
class _Write:
    host: str
    next_check: float
    stalled: bool = False


class StallGuard:
    """Watches the writes in flight (:meth:`writing`) from one daemon thread, started with the
    first write. Thread-safe."""

    def __init__(self, user_timeout_s: float = 5.0, check_after_s: float = 1.0) -> None:
        if user_timeout_s <= 0 or check_after_s <= 0:
            raise ValueError(
                f"user_timeout_s and check_after_s must be > 0, got {user_timeout_s} and "
                f"{check_after_s}"
            )
        self.user_timeout_s = user_timeout_s
        self.check_after_s = check_after_s
        self._cond = threading.Condition()
        self._ids = itertools.count()
        self._writes: dict[int, _Write] = {}
        self._resolved: dict[str, frozenset[str]] = {}
        self._thread: threading.Thread | None = None
        self._closed = False

    @contextlib.contextmanager
    def writing(self, peer_host: str) -> Iterator[None]:
        """Around one blocking write to ``peer_host``. When the write raises after it
        stalled, :meth:`quiesce` runs before the exception goes on."""
        with self._cond:
            write_id = next(self._ids)
            write = self._writes[write_id] = _Write(
                peer_host, time.monotonic() + self.check_after_s
            )
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(target=self._main, name="kv-stall", daemon=True)
                self._thread.start()
        try:
            yield
        except BaseException:
            with self._cond:
                del self._writes[write_id]
            if write.stalled:
                self.quiesce(peer_host)
            raise
        else:
            with self._cond:
                del self._writes[write_id]

    def quiesce(self, peer_host: str) -> None:
        """Bound ``peer_host``'s sockets for ``user_timeout_s`` + a second, so that whatever
        the engine still had for it has failed or landed when this returns."""
        end = time.monotonic() + self.user_timeout_s + QUIESCE_MARGIN_S
        while time.monotonic() < end:
            self._bound(peer_host)
            time.sleep(0.25)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _bound(self, host: str) -> int:
        addresses = self._resolved.get(host)
        if addresses is None:
            addresses = self._resolved[host] = peer_addresses(host)
        return bound_sockets_to(addresses, int(self.user_timeout_s * 1000))

    def _main(self) -> None:
        while True:
            with self._cond:
                if self._closed:
                    return
                now = time.monotonic()
                due = [w for w in self._writes.values() if w.next_check <= now]
                for w in due:  # again each second while stuck: new connections too
                    w.stalled, w.next_check = True, now + 1.0
                wake = min((w.next_check for w in self._writes.values()), default=now + 1.0)
            for host in {w.host for w in due}:
                if self._bound(host):
                    log.warning(
                        "a KV write to %s is stalled: its connections now fail after %.0f s "
                        "without an acknowledgement",
                        host,
                        self.user_timeout_s,
                    )
            with self._cond:
                self._cond.wait(max(0.05, wake - time.monotonic()))
