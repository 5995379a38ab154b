"""A KV write in flight to a host that goes dark (tests/multihost/netns.py): the Mooncake
transport fails it within the stated bound (``stall_timeout_s``, then as long again and a
second for its queued segments to fail; here measured), and none of its bytes can land once
the host is back: the kernel aborted the connection, so no socket to the peer still holds
data. Without the guard (dsmesh/runtime/transfer/stall.py),
Mooncake gave up after 30 s and its closed socket delivered the write when the link came
back, into pages the peer may have reused by then.

The same through prefill's transfer lanes: a release queued behind a write in flight waits
for it. The writer is this process, on the bridge's address; the peer runs
tests/multihost/transfer_peer.py inside a host."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest

pytest.importorskip("mooncake.engine")

from dsmesh.engine.kv.pool import MLAKVPool  # noqa: E402
from dsmesh.prefill_svc.transfer_queue import (  # noqa: E402
    ChunkJob,
    FinalJob,
    TransferCallbacks,
    TransferQueue,
)
from dsmesh.runtime.transfer import RemotePool, TransferError  # noqa: E402
from dsmesh.runtime.transfer.mooncake import MooncakeTransport  # noqa: E402
from tests.multihost import netns, transfer_peer  # noqa: E402

pytestmark = pytest.mark.timeout(120)
PROGRESS_TIMEOUT_ENV = "MC_TCP_PROGRESS_TIMEOUT_SEC"
WRITE_FAILED_BOUND_S = 15.0  # docs/RELIABILITY.md's bound for a write to a dark host
# shorter than the transport's default (5 s), to keep the test short: the mechanism is the
# same, and tests/multihost/test_across_hosts.py measures the default inside the mesh
STALL_TIMEOUT_S = 2.0


class Peer:
    def __init__(self, host: netns.Host) -> None:
        argv = host.command([sys.executable, "-m", "tests.multihost.transfer_peer", host.address])
        self.process = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        self.remote = RemotePool(**json.loads(self._line()))

    def _line(self) -> str:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        assert line, f"the peer exited ({self.process.poll()})"
        return line

    def pages(self) -> list[list[float]]:
        assert self.process.stdin is not None
        self.process.stdin.write("pages\n")
        self.process.stdin.flush()
        return json.loads(self._line())

    def stop(self) -> None:
        self.process.kill()
        self.process.wait()


def unsent_bytes_to(address: str) -> list[str]:
    """This namespace's TCP sockets to ``address`` that still hold bytes to send (Send-Q;
    a connection still being opened counts its SYN there, and carries no data)."""
    out = subprocess.run(
        ["ss", "-tnH", "state", "all", "dst", address], capture_output=True, text=True, check=True
    ).stdout
    return [
        line
        for line in out.splitlines()
        if line.split()[0] != "SYN-SENT" and int(line.split()[2]) > 0
    ]


@pytest.fixture
def dark_able_peer() -> Iterator[tuple[netns.Host, Peer, MooncakeTransport, MLAKVPool]]:
    """A peer on a host of its own, and this process's transport with a registered pool whose
    page 0 (all ones) was written into the peer's page 0."""
    if (reason := netns.unavailable_reason()) is not None:
        pytest.skip(f"multi-host tests need network namespaces: {reason}")
    with netns.network(1) as net:
        (host,) = net.hosts
        peer = Peer(host)
        progress_timeout = os.environ.get(PROGRESS_TIMEOUT_ENV)  # the transport sets it
        transport = MooncakeTransport(hostname=net.bridge_address, stall_timeout_s=STALL_TIMEOUT_S)
        try:
            local = transfer_peer.pool()
            transport.register_pool(local)
            local.buffer[:, 0] = 1.0
            transport.write_pages(local, peer.remote, [0], [0])
            assert peer.pages()[0] == [1.0]
            yield host, peer, transport, local
        finally:
            host.link_up()
            transport.close()
            peer.stop()
            if progress_timeout is None:  # what processes started later inherit
                os.environ.pop(PROGRESS_TIMEOUT_ENV, None)


def test_a_write_to_a_dark_host_fails_and_never_lands_later(dark_able_peer) -> None:
    host, peer, transport, local = dark_able_peer
    host.link_down()
    local.buffer[:, 1] = 2.0
    start = time.monotonic()
    with pytest.raises(TransferError):
        transport.write_pages(local, peer.remote, [1], [1])
    failed_s = time.monotonic() - start
    assert failed_s <= WRITE_FAILED_BOUND_S
    # the kernel dropped the connection and what it held: nothing left to deliver
    assert unsent_bytes_to(host.address) == []
    host.link_up()

    local.buffer[:, 2] = 3.0
    written_back = threading.Event()

    def write_again() -> None:  # a new connection, once the link is back
        transport.write_pages(local, peer.remote, [2], [2])
        written_back.set()

    writer = threading.Thread(target=write_again)
    writer.start()
    writer.join(WRITE_FAILED_BOUND_S + 5)
    assert written_back.is_set()
    assert peer.pages()[:3] == [[1.0], [0.0], [3.0]]
    print(f"MULTIHOST transfer_stall write_failed_s={failed_s:.2f}")


def test_prefill_lanes_release_only_after_the_write_in_flight_ended(dark_able_peer) -> None:
    """Prefill's transfer lanes (dsmesh/prefill_svc/transfer_queue.py) over the real transport: a
    request aborted after its final job was queued, while its write to the dark host is in
    flight, is released (decode may reuse its pages) only once that write has ended."""
    host, peer, transport, local = dark_able_peer
    events: list[str] = []
    released = threading.Event()
    callbacks = TransferCallbacks(
        on_chunk=lambda rid, tokens, nbytes: events.append("chunk"),
        on_final=lambda rid, token, nbytes, seconds: events.append("final"),
        on_error=lambda rid, cause, message: events.append("error"),
        on_release=lambda rid: (events.append("release"), released.set()),
    )
    lanes = TransferQueue(transport, local, callbacks)
    try:
        host.link_down()
        lanes.begin("r1")
        lanes.put(ChunkJob("r1", [1], [1], peer.remote, tokens_done=16))
        deadline = time.monotonic() + 10
        while not unsent_bytes_to(host.address):  # the write's bytes wait for an ack
            assert time.monotonic() < deadline, "the write never started"
            time.sleep(0.02)
        lanes.put(FinalJob("r1", first_token=7))
        lanes.abort("r1")  # e.g. kv_broker failed the handoff: decode's host is lost
        assert released.wait(WRITE_FAILED_BOUND_S + 5)
        assert events == ["error", "release"]
    finally:
        lanes.stop()
