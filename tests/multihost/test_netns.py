"""The harness itself: hosts reach each other, and whatever a run leaves behind (namespaces,
links, processes inside) is removed, by the run itself or, had it died, by the next one."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.multihost import netns


@pytest.fixture(scope="module", autouse=True)
def _needs_namespaces() -> None:
    if (reason := netns.unavailable_reason()) is not None:
        pytest.skip(f"multi-host tests need network namespaces: {reason}")


def _names() -> tuple[list[str], list[str]]:
    return netns._namespaces(), netns._links()


def test_hosts_reach_each_other_and_everything_goes_at_the_end() -> None:
    with netns.network(2) as net:
        a, b = net.hosts
        assert netns.ip("-n", a.name, "-br", "addr", "show", "lo").split()[1] == "UNKNOWN"
        server = subprocess.Popen(
            b.command(
                [
                    sys.executable,
                    "-c",
                    "import socket; s = socket.create_server(('0.0.0.0', 7000));"
                    "c, _ = s.accept(); c.sendall(c.recv(16))",
                ]
            )
        )
        try:
            reply = subprocess.run(
                a.command(
                    [
                        sys.executable,
                        "-c",
                        "import socket, time\n"
                        "for _ in range(50):\n"
                        "    try:\n"
                        f"        c = socket.create_connection(('{b.address}', 7000), 1); break\n"
                        "    except OSError: time.sleep(0.1)\n"
                        "c.sendall(b'ping'); print(c.recv(16).decode())",
                    ]
                ),
                capture_output=True,
                text=True,
                timeout=30,
            )
            assert reply.stdout.strip() == "ping", reply.stderr
        finally:
            server.kill()
            server.wait()
        names = (net.bridge, *(h.port_link for h in net.hosts))
    namespaces, links = _names()
    assert not {h.name for h in net.hosts} & set(namespaces)
    assert not set(names) & set(links)


def test_a_dead_runs_leftovers_are_removed() -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()  # its pid is no run's any more
    owner = f"{netns.PREFIX}{dead.pid}a"
    namespace, link = f"{owner}-h0", f"{owner}br"
    netns.ip("netns", "add", namespace)
    netns.ip("link", "add", link, "type", "bridge")
    sleeper = subprocess.Popen(["ip", "netns", "exec", namespace, "sleep", "60"])
    try:
        netns.remove_stale()
        assert sleeper.wait(10) != 0  # killed with its namespace
        namespaces, links = _names()
        assert namespace not in namespaces and link not in links
    finally:
        sleeper.kill()
        netns.remove(owner)


SINK = """
import hashlib, socket
s = socket.create_server(("0.0.0.0", 7001))
c, _ = s.accept()
h = hashlib.sha256()
while data := c.recv(65536):
    h.update(data)
c.sendall(h.hexdigest().encode())
"""

SOURCE = """
import socket, sys, time
payload = bytes(range(256)) * 800  # 200 KiB
for _ in range(100):
    try:
        c = socket.create_connection((sys.argv[1], 7001), 2); break
    except OSError: time.sleep(0.1)
start = time.monotonic()
c.sendall(payload)
c.shutdown(socket.SHUT_WR)
digest = c.recv(100).decode()
print(digest, time.monotonic() - start)
"""


def _tcp_retransmissions(host: netns.Host) -> int:
    snmp = subprocess.run(
        host.command(["cat", "/proc/net/snmp"]), capture_output=True, text=True, check=True
    ).stdout
    names, values = [line.split() for line in snmp.splitlines() if line.startswith("Tcp:")]
    return int(values[names.index("RetransSegs")])


def _send_through(a: netns.Host, b: netns.Host) -> tuple[str, float]:
    sink = subprocess.Popen(b.command([sys.executable, "-c", SINK]))
    try:
        out = subprocess.run(
            a.command([sys.executable, "-c", SOURCE, b.address]),
            capture_output=True,
            text=True,
            timeout=60,
        )
        digest, seconds = out.stdout.split()
        return digest, float(seconds)
    finally:
        sink.kill()
        sink.wait()


def test_user_space_impairment_delays_and_drops_real_packets() -> None:
    """The TUN forwarder (used where the kernel has no sch_netem, and here even where it
    has): a TCP transfer between two hosts arrives whole, no sooner than the delay allows,
    after the sender's TCP retransmitted what was dropped; afterwards the TUN devices are
    gone and the hosts talk over the bridge again."""
    import hashlib

    want = hashlib.sha256(bytes(range(256)) * 800).hexdigest()
    with netns.network(2) as net:
        a, b = net.hosts
        before = _tcp_retransmissions(a)
        with netns.user_space_impairment(net, delay_ms=50, loss_percent=10, seed=1):
            digest, seconds = _send_through(a, b)
            retransmitted = _tcp_retransmissions(a) - before
            tuns = netns.ip("-n", a.name, "-br", "link")
        assert digest == want
        assert seconds >= 0.1  # the data and the digest's way back: 50 ms each at least
        assert retransmitted > 0
        assert f"{net.owner}t0" in tuns
        assert f"{net.owner}t0" not in netns.ip("-n", a.name, "-br", "link")
        assert _send_through(a, b)[0] == want
        print(f"MULTIHOST tun_impairment seconds_200KiB={seconds:.2f} retrans={retransmitted}")
