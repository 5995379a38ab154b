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
