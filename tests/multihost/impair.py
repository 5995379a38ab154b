"""Delay and loss in user space, for kernels without ``sch_netem``: the packet forwarder that
:func:`tests.multihost.netns.user_space_impairment` runs between the hosts' TUN devices.

``python -m tests.multihost.impair --delay-ms D --loss P --seed S FD=ADDRESS ...``: each
``FD`` (inherited) is a TUN device (``IFF_TUN | IFF_NO_PI``: bare IP packets) that carries the
traffic of the host at ``ADDRESS`` to the other hosts. Every IPv4 packet read from one is
dropped with probability P (a ``random.Random(S)``: the same drops for the same packet
sequence), or else written to the TUN device of the host it is addressed to D milliseconds
later, in order; packets to no known host, and anything not IPv4, are dropped. It runs until
its stdin closes (the parent exits or ends the impairment).
"""

from __future__ import annotations

import argparse
import contextlib
import heapq
import itertools
import os
import random
import select
import socket
import sys
import time


def forward(tuns: dict[int, str], delay_s: float, loss: float, seed: int) -> None:
    """``tuns``: TUN fd -> its host's IPv4 address. Returns when stdin reaches EOF."""
    route = {socket.inet_aton(address): fd for fd, address in tuns.items()}
    rng = random.Random(seed)
    order = itertools.count()
    due: list[tuple[float, int, int, bytes]] = []  # (when, order, out fd, packet)
    poller = select.poll()
    for fd in tuns:
        os.set_blocking(fd, False)
        poller.register(fd, select.POLLIN)
    stdin = sys.stdin.fileno()
    poller.register(stdin, select.POLLIN | select.POLLHUP)
    while True:
        timeout_ms = max(0, (due[0][0] - time.monotonic()) * 1000) if due else None
        for fd, _ in poller.poll(timeout_ms):
            if fd == stdin:
                if not os.read(stdin, 4096):
                    return
                continue
            while True:
                try:
                    packet = os.read(fd, 65536)
                except BlockingIOError:
                    break
                if len(packet) < 20 or packet[0] >> 4 != 4:
                    continue
                out = route.get(packet[16:20])
                if out is None or rng.random() < loss:
                    continue
                heapq.heappush(due, (time.monotonic() + delay_s, next(order), out, packet))
        now = time.monotonic()
        while due and due[0][0] <= now:
            _, _, out, packet = heapq.heappop(due)
            # A full queue (BlockingIOError) or a device that is down (EIO, as at teardown):
            # the packet is lost like any other, and the forwarder goes on.
            with contextlib.suppress(OSError):
                os.write(out, packet)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--delay-ms", type=float, required=True)
    parser.add_argument("--loss", type=float, required=True, help="probability, 0..1")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("tuns", nargs="+", metavar="FD=ADDRESS")
    args = parser.parse_args()
    tuns = {int(fd): address for fd, address in (t.split("=", 1) for t in args.tuns)}
    forward(tuns, args.delay_ms / 1000, args.loss, args.seed)


if __name__ == "__main__":
    main()
