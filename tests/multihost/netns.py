"""Hosts on one machine: network namespaces joined by a bridge, each with its own IP.

:func:`network` makes ``n`` hosts for the life of a ``with`` block and removes them after it,
whatever happened inside, killing the processes still running in them (stop the services a
test ran there, :meth:`Host.command`, first, to let them end cleanly). Names carry this
process's pid and a letter per network (``dsm<pid><tag>``), so parallel runs don't collide,
and what a run that died left behind is removed by the next one (:func:`remove_stale`).

Addresses come from 198.18.0.0/15, the range RFC 2544 reserves for benchmarking networks:
a /24 per network that no interface of the machine uses, ``.1`` on the bridge (so this
process reaches every host), ``.2`` onwards for the hosts. Each host has loopback up and a
default route out of its interface (no gateway: nothing leaves the machine), so a service
bound to 0.0.0.0 finds its own address as "the default route's".

Faults: :meth:`Host.link_down` / :meth:`Host.link_up` (the host's cable: its bridge port) and
:meth:`Network.impair` (delay and loss on every link, each packet between two hosts delayed
once). ``impair`` uses ``tc netem`` on every host's bridge port where the kernel has
``sch_netem``. Where it does not (the CPU box and its CI: "Specified qdisc kind is unknown"),
it impairs the links in user space with real packets (:func:`user_space_impairment`): every
host, and this namespace as the client, gets a TUN device with a /32 route through it to each
of the others, and a forwarder process (tests/multihost/impair.py) reads each IP packet from
the sender's TUN, drops it with the given probability (seeded), and writes it into the
receiver's TUN after the delay. The hosts' TCP stacks see real loss and delay:
retransmissions, RTOs, congestion windows. Ending the impairment ends the forwarder; its TUN
devices, and the routes through them, go with it.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

# A network of run <pid> is named dsm<pid><tag> (tag: a letter per network of the run): its
# namespaces dsm<pid><tag>-h<i>, its bridge dsm<pid><tag>br, its hosts' bridge ports
# dsm<pid><tag>h<i>, the TUN devices of a user-space impairment dsm<pid><tag>t<i> (15
# characters at most, as Linux wants).
PREFIX = "dsm"
_NAME = re.compile(rf"^({PREFIX}(\d+)[a-z]?)(?:-h\d+|-probe|br|h\d+|n\d+|t\d+)$")
_TAGS = iter("abcdefghijklmnopqrstuvwxyz")
SUPERNET = ipaddress.IPv4Network("198.18.0.0/15")  # RFC 2544
TUNSETIFF, IFF_TUN, IFF_NO_PI = 0x400454CA, 0x0001, 0x1000  # linux/if_tun.h


class NetnsError(RuntimeError):
    pass


def ip(*args: str, check: bool = True) -> str:
    """Run ``ip ARGS``; its stdout, or NetnsError with its stderr."""
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise NetnsError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


def tc(*args: str) -> None:
    done = subprocess.run(["tc", *args], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise NetnsError(f"tc {' '.join(args)}: {done.stderr.strip()}")


def unavailable_reason() -> str | None:
    """Why namespaces cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"{' and '.join(missing)} not installed (iproute2)"
    probe = f"{PREFIX}{os.getpid()}-probe"
    try:
        ip("netns", "add", probe)
    except NetnsError as exc:
        return f"cannot create a network namespace: {exc}"
    ip("netns", "delete", probe, check=False)
    return None


@dataclass(frozen=True)
class Host:
    name: str  # the namespace
    address: str  # its IP on the bridge
    port_link: str  # its veth's end on the bridge (this side), what link_down cuts

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` run inside this host."""
        return ["ip", "netns", "exec", self.name, *argv]

    def link_down(self) -> None:
        """Unplug the host: packets to and from it are dropped, its sockets stay open."""
        ip("link", "set", self.port_link, "down")

    def link_up(self) -> None:
        """Plug the host back in. The neighbour entry the outage left FAILED is flushed, as a
        replugged cable's would age out, so the next connection resolves the host again
        instead of failing with "No route to host"."""
        ip("link", "set", self.port_link, "up")
        ip("neigh", "flush", "to", self.address, check=False)


@dataclass(frozen=True)
class Network:
    bridge: str
    bridge_address: str
    hosts: tuple[Host, ...]

    def netem_unavailable_reason(self) -> str | None:
        """Why :meth:`netem` cannot work here (None: it can)."""
        link = self.hosts[0].port_link
        try:
            tc("qdisc", "add", "dev", link, "root", "netem", "delay", "0ms")
        except NetnsError as exc:
            return f"tc netem does not work here (a kernel without sch_netem?): {exc}"
        tc("qdisc", "del", "dev", link, "root")
        return None

    @property
    def owner(self) -> str:
        return self.bridge.removesuffix("br")

    @contextlib.contextmanager
    def impair(self, delay_ms: float, loss_percent: float, seed: int = 0) -> Iterator[str]:
        """Delay and loss on every link while the block runs; yields how: "netem" or
        "user space" (see the module's notes)."""
        if self.netem_unavailable_reason() is None:
            self.netem(delay_ms, loss_percent)
            try:
                yield "netem"
            finally:
                self.netem()
        else:
            with user_space_impairment(self, delay_ms, loss_percent, seed):
                yield "user space"

    def netem(self, delay_ms: float = 0, loss_percent: float = 0) -> None:
        """Delay and drop the packets into every host; ``netem()`` with no argument clears."""
        for host in self.hosts:
            with contextlib.suppress(NetnsError):
                tc("qdisc", "del", "dev", host.port_link, "root")
            if delay_ms or loss_percent:
                tc(
                    "qdisc",
                    "add",
                    "dev",
                    host.port_link,
                    "root",
                    "netem",
                    "delay",
                    f"{delay_ms}ms",
                    "loss",
                    f"{loss_percent}%",
                )


def _open_tun(name: str) -> int:
    """A new TUN device ``name`` (bare IP packets), in this namespace; its fd. It lives while
    the fd is open, wherever it is moved."""
    fd = os.open("/dev/net/tun", os.O_RDWR)
    try:
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    except OSError:
        os.close(fd)
        raise
    return fd


@contextlib.contextmanager
def user_space_impairment(
    net: Network, delay_ms: float, loss_percent: float, seed: int = 0
) -> Iterator[None]:
    """Route the traffic between every two of ``net``'s hosts, and between this namespace
    and each host, through TUN devices and tests/multihost/impair.py's forwarder, which
    delays every packet ``delay_ms`` and drops ``loss_percent`` % of them."""
    # (namespace or None for this one, address, TUN name)
    ends = [(h.name, h.address, f"{net.owner}t{i}") for i, h in enumerate(net.hosts)]
    ends.append((None, net.bridge_address, f"{net.owner}t{len(net.hosts)}"))
    fds: list[int] = []
    forwarder = None
    try:
        for _, _, tun in ends:
            fds.append(_open_tun(tun))
        # Every device up before the forwarder starts: a packet written to a device that is
        # not up yet fails (EIO), which once killed the forwarder and cut every link mid-test.
        for namespace, _, tun in ends:
            inside: tuple[str, ...] = ()
            if namespace is not None:
                ip("link", "set", tun, "netns", namespace)
                inside = ("-n", namespace)
            ip(*inside, "link", "set", tun, "up")
        argv = [sys.executable, "-m", "tests.multihost.impair", "--delay-ms", str(delay_ms)]
        argv += ["--loss", str(loss_percent / 100), "--seed", str(seed)]
        argv += [f"{fd}={address}" for fd, (_, address, _) in zip(fds, ends, strict=True)]
        root = Path(__file__).resolve().parents[2]
        forwarder = subprocess.Popen(argv, stdin=subprocess.PIPE, pass_fds=fds, cwd=root)
        for namespace, address, tun in ends:  # then the routes through them
            inside = ("-n", namespace) if namespace is not None else ()
            for _, other, _ in ends:
                if other != address:
                    ip(*inside, "route", "add", f"{other}/32", "dev", tun, "src", address)
        yield
    finally:
        if forwarder is not None:
            forwarder.stdin.close()  # type: ignore[union-attr]
            try:
                forwarder.wait(10)
            except subprocess.TimeoutExpired:
                forwarder.kill()
                forwarder.wait()
        for fd in fds:  # the last reference: the devices and their routes go
            os.close(fd)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_inside(namespace: str) -> None:
    """SIGKILL whatever still runs in ``namespace`` (a dead run's services)."""
    for word in ip("netns", "pids", namespace, check=False).split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(word), signal.SIGKILL)


def _owned(name: str, owner: str | None) -> bool:
    """Is ``name`` one of network ``owner``'s (``dsm<pid><tag>``), or, with ``owner`` None,
    left behind by a run that died?"""
    m = _NAME.match(name)
    if m is None:
        return False
    if owner is None:
        return not _pid_alive(int(m.group(2)))
    return m.group(1) == owner


def _namespaces() -> list[str]:
    return [line.split()[0] for line in ip("netns", "list").splitlines() if line.strip()]


def _links() -> list[str]:
    return [line.split()[0].split("@")[0] for line in ip("-br", "link").splitlines() if line]


def remove(owner: str | None) -> None:
    """Remove the namespaces and links of network ``owner`` (see :func:`_owned`; None: of
    every run that died), after killing what still runs inside them."""
    for namespace in _namespaces():
        if _owned(namespace, owner):
            _kill_inside(namespace)
            ip("netns", "delete", namespace, check=False)
    for link in _links():
        if _owned(link, owner):
            ip("link", "delete", link, check=False)


def remove_stale() -> None:
    remove(None)


def _free_subnet(pid: int) -> ipaddress.IPv4Network:
    """A /24 of 198.18.0.0/15 that no interface of this machine uses, chosen from ``pid``."""
    used = [
        ipaddress.ip_interface(word).network
        for line in ip("-br", "-4", "addr").splitlines()
        for word in line.split()[2:]
    ]
    subnets = list(SUPERNET.subnets(new_prefix=24))
    for i in range(len(subnets)):
        candidate = subnets[(pid + i) % len(subnets)]
        if not any(candidate.overlaps(net) for net in used):
            return candidate
    raise NetnsError("every /24 of 198.18.0.0/15 is in use")


@contextlib.contextmanager
def network(num_hosts: int) -> Iterator[Network]:
    """``num_hosts`` hosts on one bridge; everything is removed on exit, processes still
    running inside included."""
    pid = os.getpid()
    remove_stale()
    owner = f"{PREFIX}{pid}{next(_TAGS)}"
    subnet = _free_subnet(pid)
    addresses = list(subnet.hosts())
    bridge = f"{owner}br"
    prefix = subnet.prefixlen
    try:
        ip("link", "add", bridge, "type", "bridge")
        ip("addr", "add", f"{addresses[0]}/{prefix}", "dev", bridge)
        ip("link", "set", bridge, "up")
        hosts = []
        for i in range(num_hosts):
            namespace, port_link, inner = (
                f"{owner}-h{i}",
                f"{owner}h{i}",
                f"{owner}n{i}",
            )
            address = str(addresses[i + 1])
            ip("netns", "add", namespace)
            ip("link", "add", port_link, "type", "veth", "peer", "name", inner)
            ip("link", "set", inner, "netns", namespace)
            ip("link", "set", port_link, "master", bridge)
            ip("link", "set", port_link, "up")
            inside = ("-n", namespace)
            ip(*inside, "link", "set", inner, "name", "eth0")
            ip(*inside, "addr", "add", f"{address}/{prefix}", "dev", "eth0")
            ip(*inside, "link", "set", "eth0", "up")
            ip(*inside, "link", "set", "lo", "up")
            ip(*inside, "route", "add", "default", "dev", "eth0")
            hosts.append(Host(namespace, address, port_link))
        yield Network(bridge, str(addresses[0]), tuple(hosts))
    finally:
        remove(owner)
