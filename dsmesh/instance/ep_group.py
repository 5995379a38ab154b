"""Run a prefill or decode instance as an expert-parallel group of rank processes.

``dsmesh prefill|decode --ep-size N`` starts ``N / nnodes`` rank processes on this host (one
per GPU) and supervises them. Each rank is a full mesh member: its own engine with its own
requests and KV pages (DP attention), its own transfer engine, gRPC server and kv_broker
registration (instance ``<id>-ep<rank>``), so KV moves straight to and from the rank that
owns the pages and the gateway spreads requests over the ranks by load. The ranks share only
the MoE layers: their engine workers step in lockstep over torch.distributed.

The parent prints the ranks' ``listening on`` lines once all of them serve, forwards SIGTERM
and SIGINT for a graceful stop, and, when any rank dies, stops the others and exits non-zero:
a group missing a rank cannot step, so a supervisor restarts it whole.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing as mp
import os
import queue
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from dsmesh.engine.ep.runtime import EPConfig, check_dispatch, check_placement, free_port

log = logging.getLogger(__name__)
Ready = Callable[[str, int], None]
FATAL_EXIT_CODE = 70
# A peer whose host goes dark sends no RST: a rank would wait in its next collective until
# --ep-timeout (120 s by default, sized for slow steps, not for dead links). The connections
# the group opens at start-up (gloo's pairs, the rendezvous) get this bound instead: a peer
# silent this long (its kernel acknowledges neither data nor keepalive probes) fails the
# collective, sending or receiving, and the group stops (dsmesh/runtime/tcp_timeout.py). A
# live peer's kernel answers whatever its rank is doing.
GROUP_LINK_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class RankSpec:
    """One rank of a group, as seen by the process that runs it."""

    ep: EPConfig
    local_rank: int
    group_id: str = ""  # the instance id the group shares (EPLB knows the group by it)
    eplb_address: str = ""  # eplb_svc HOST:PORT; empty = no live rebalancing
    eplb_report_interval_s: float = 1.0

    @property
    def rank(self) -> int:
        return self.ep.global_rank(self.local_rank)


def rank_port(base: int, spec: RankSpec) -> int:
    """Ranks of a host listen on consecutive ports from ``base``; 0 stays "any free port"."""
    return base + spec.local_rank if base else 0


def rank_instance_id(base: str, spec: RankSpec) -> str:
    return f"{base}-ep{spec.rank}"


def fatal_exit(exc: BaseException) -> None:
    """The group is broken (a peer died or a collective timed out): leave at once, so the
    parent stops the other ranks; the engine thread cannot unwind a blocked collective."""
    log.critical("leaving the expert-parallel group: %s", exc)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(FATAL_EXIT_CODE)


def _rank_main(
    target: RankTarget,
    spec: RankSpec,
    ready_queue: mp.Queue,
    log_level: int,
    threads: int,
    switch_interval_s: float,
) -> None:
    logging.basicConfig(
        level=log_level,
        format=f"%(asctime)s %(levelname)s ep{spec.rank} %(name)s: %(message)s",
    )
    import torch

    from dsmesh.engine.ep.runtime import init_group, rank_device
    from dsmesh.runtime.tcp_timeout import set_peer_timeout, socket_inodes

    if threads:
        torch.set_num_threads(threads)
    sys.setswitchinterval(switch_interval_s)  # as the parent's command set it
    code = 0
    try:
        before = socket_inodes()
        init_group(spec.ep, spec.rank, rank_device(target.engine_config, spec.rank))
        set_peer_timeout(socket_inodes() - before, int(GROUP_LINK_TIMEOUT_S * 1000))
        target(spec, lambda iid, port: ready_queue.put((spec.local_rank, iid, port)))
    except BaseException:  # noqa: BLE001 - reported, then the parent stops the group
        log.exception("rank %d failed", spec.rank)
        code = 1
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip interpreter teardown: a peer's blocked collective must not hang it


def rank_config(config, spec: RankSpec):
    """A prefill or decode config for one rank: its port, metrics port, instance id."""
    return dataclasses.replace(
        config,
        port=rank_port(config.port, spec),
        metrics_port=rank_port(config.metrics_port, spec),
        instance_id=rank_instance_id(config.instance_id, spec),
        ep_rank=dataclasses.replace(spec, group_id=config.instance_id),
    )


class RankTarget:
    """Picklable: serves one rank with the service's ``serve(config, stop, ready)``.

    ``config`` is the instance's frozen config with its ``instance_id`` already chosen, so
    every rank's id shares it.
    """

    def __init__(self, serve: Callable, config) -> None:
        if not config.instance_id:
            raise ValueError("an expert-parallel instance needs its instance_id chosen first")
        self.serve = serve
        self.config = config
        self.engine_config = config.engine

    def __call__(self, spec: RankSpec, ready: Ready) -> None:
        from dsmesh.runtime.grpc_server import run_until_signal

        config = rank_config(self.config, spec)
        run_until_signal(lambda stop: self.serve(config, stop, ready))


def run_group(
    ep: EPConfig,
    target: RankTarget,
    print_ready: Callable[[str, int], None],
    stop_grace_s: float = 20.0,
    eplb_address: str = "",
    eplb_report_interval_s: float = 1.0,
) -> int:
    """Start this host's ranks, supervise them until a signal or a rank's death."""
    ep.validate()
    check_dispatch(ep)
    check_placement(target.engine_config, ep)
    if ep.master_port == 0:
        ep = dataclasses.replace(ep, master_port=free_port())
    cpus = os.cpu_count() or 1
    on_cpu = target.engine_config.resolved_device().type == "cpu"
    threads = max(1, cpus // ep.local_size) if on_cpu else 0  # ranks share the cores
    ctx = mp.get_context("spawn")
    ready_queue: mp.Queue = ctx.Queue()
    specs = [
        RankSpec(ep, i, eplb_address=eplb_address, eplb_report_interval_s=eplb_report_interval_s)
        for i in range(ep.local_size)
    ]
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(
                target,
                spec,
                ready_queue,
                logging.getLogger().level,
                threads,
                sys.getswitchinterval(),
            ),
            name=f"ep-rank-{spec.rank}",
            daemon=False,
        )
        for spec in specs
    ]
    stopping = False

    def on_signal(signum, frame) -> None:  # noqa: ARG001
        nonlocal stopping
        stopping = True

    old = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        for p in procs:
            p.start()
        log.info(
            "expert-parallel group: ranks %d..%d of %d on this host (master %s:%d)",
            specs[0].rank,
            specs[-1].rank,
            ep.ep_size,
            ep.master_addr,
            ep.master_port,
        )
        ready: dict[int, tuple[str, int]] = {}
        announced = False
        while True:
            with contextlib.suppress(queue.Empty):
                while True:
                    local_rank, instance_id, port = ready_queue.get_nowait()
                    ready[local_rank] = (instance_id, port)
            if not announced and len(ready) == len(procs):
                for i in range(len(procs)):
                    print_ready(*ready[i])
                announced = True
            if stopping:
                _stop_all(procs, stop_grace_s)
                return 0
            dead = [(spec, p) for spec, p in zip(specs, procs, strict=True) if not p.is_alive()]
            if dead:
                spec, p = dead[0]
                log.error(
                    "rank %d exited with code %s; stopping the expert-parallel group",
                    spec.rank,
                    p.exitcode,
                )
                _stop_all(procs, stop_grace_s)
                return 1
            time.sleep(0.1)
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def _stop_all(procs: list, grace_s: float) -> None:
    for p in procs:
        if p.is_alive() and p.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)
