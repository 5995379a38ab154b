"""An expert-parallel decode group across two hosts behind the mesh (tests/multihost/conftest.py):
two ranks on each (``--ep-size 4 --ep-nnodes 2``, gloo, redundant experts), live rebalancing
by an eplb service on a third host. It serves the offline engine's tokens (EP 1) before and
after an EPLB swap, whose placement crosses the hosts through the group; when one host goes
dark the group fails fast (its links' TCP user timeout, dsmesh/instance/ep_group.py),
kv_broker drops every rank so the gateway stops routing to them (a request then waits in the
gateway's queue, not on the dead group), and the group restarted once the host is back serves
it and the rest.

Runs after test_across_hosts.py on the same mesh: the first test replaces its decode with
the group. Figures print as ``MULTIHOST <scenario> <name>=<value>`` lines (``-s``).
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from dsmesh.engine.llm_engine import LLMEngine
from dsmesh.instance.ep_group import GROUP_LINK_TIMEOUT_S
from dsmesh.v1 import decode_pb2_grpc, eplb_pb2, eplb_pb2_grpc, prefill_pb2
from dsmesh.v1 import kv_broker_pb2 as kb
from tests.multihost.client import (
    STREAM_BOUND_S,
    assert_pages_return_to_zero_on,
    greedy,
    grpc_streams,
    prompts,
    report,
    request,
    serves,
)
from tests.multihost.conftest import (
    DECODE_PORT,
    EP_MASTER_PORT,
    LIVENESS_GRACE_S,
    Mesh,
    wait_until,
)

pytestmark = pytest.mark.timeout(300)
EPLB_PORT = 50055
GROUP_ID = "decode-ep"
RANKS_PER_HOST = 2
EP_SIZE = 2 * RANKS_PER_HOST  # over two hosts
# the group's links fail after GROUP_LINK_TIMEOUT_S without an acknowledgement; the dark
# rank leaves kv_broker's list once keepalive noticed (8 s at most) and the grace passed
GROUP_FAILED_BOUND_S = GROUP_LINK_TIMEOUT_S + 5
ROUTING_STOPPED_BOUND_S = GROUP_LINK_TIMEOUT_S + STREAM_BOUND_S + LIVENESS_GRACE_S


def start_group(mesh: Mesh) -> float:
    """Start the decode group: node 0 on the decode host, node 1 on the spare one, each
    serving once the group is whole; the seconds it took."""
    node0 = mesh.hosts["decode"]
    group = ("--ep-size", str(EP_SIZE), "--ep-nnodes", "2", "--num-redundant-experts", "4")
    common = (
        *("decode", "--broker", mesh.broker, "--host", "0.0.0.0", "--port", str(DECODE_PORT)),
        *("--model", str(mesh.model_dir), "--drain-timeout", "1", *group),
        *("--ep-master-port", str(EP_MASTER_PORT), "--instance-id", GROUP_ID),
        *("--eplb", mesh.services["eplb"].address, "--eplb-report-interval", "0.5"),
    )
    nodes = {
        "decode": ("decode", (*common, "--ep-node-rank", "0")),
        "decode-ep1": (
            "spare",
            (*common, "--ep-node-rank", "1", "--ep-master-addr", node0.address),
        ),
    }
    start = time.monotonic()
    with ThreadPoolExecutor(2) as pool:
        started = [
            pool.submit(mesh.start, name, host, *args) for name, (host, args) in nodes.items()
        ]
        for future in started:
            future.result()
    return time.monotonic() - start


def decode_ranks(mesh: Mesh) -> list[kb.Instance]:
    return [i for i in mesh.instances() if i.role == kb.ROLE_DECODE]


def every_rank_free(mesh: Mesh) -> None:
    """Every rank of the group (each its own instance, at its own port) holds no page."""
    ranks = decode_ranks(mesh)
    assert len(ranks) == EP_SIZE, ranks
    for rank in ranks:

        def free(address: str = rank.grpc_address) -> bool:
            with grpc.insecure_channel(address) as ch:
                load = decode_pb2_grpc.DecodeStub(ch).GetLoad(prefill_pb2.LoadRequest(), timeout=2)
            return load.free_pages == load.total_pages > 0

        assert wait_until(free, 10), f"{rank.instance_id} still holds pages"


def eplb_call(mesh: Mesh, method: str, request):
    with grpc.insecure_channel(mesh.services["eplb"].address) as ch:
        return getattr(eplb_pb2_grpc.EPLBStub(ch), method)(request, timeout=10)


def group_load(mesh: Mesh) -> eplb_pb2.InstanceLoad | None:
    loads = eplb_call(mesh, "GetLoad", eplb_pb2.GetLoadRequest()).instances
    return next((load for load in loads if load.instance_id == GROUP_ID), None)


def test_an_ep_group_spans_two_hosts_and_swaps_experts(mesh: Mesh, offline: LLMEngine) -> None:
    """Each rank registers its own host's address and serves the offline tokens, before and
    after a forced EPLB rebalance that the group applies on both hosts."""
    mesh.services.pop("decode").stop()
    assert wait_until(lambda: not decode_ranks(mesh), 10)
    # no periodic rebalance: the test forces the one it checks
    eplb_args = ("--host", "0.0.0.0", "--port", str(EPLB_PORT), "--interval", "3600")
    mesh.start("eplb", "kv-broker", "eplb", "serve", *eplb_args, "--window-steps", "50")
    group_up = start_group(mesh)

    listed = wait_until(lambda: (r := decode_ranks(mesh)) and len(r) == EP_SIZE and r, 60)
    assert listed, mesh.log_tails()
    assert sorted(i.grpc_address for i in listed) == sorted(
        f"{mesh.hosts[h].address}:{DECODE_PORT + i}"
        for h in ("decode", "spare")
        for i in range(RANKS_PER_HOST)
    )
    # A rank is listed once it attached; the first KV write to a host that just came up can
    # still fail (this package's gateway does not migrate: --migration-limit 0), so the group
    # first serves one request, retried, then the batch that is checked.
    assert serves(mesh, offline), mesh.log_tails()
    ids = prompts(8, salt=4)
    got = asyncio.run(grpc_streams(mesh.grpc_address, [request(p, 6) for p in ids]))
    assert got == greedy(offline, ids, 6)

    load = wait_until(lambda: (g := group_load(mesh)) is not None and g.window_steps > 0 and g, 20)
    assert load, "the group reported no expert load"
    before = list(load.physical_to_logical)
    asked = time.monotonic()
    response = eplb_call(mesh, "Rebalance", eplb_pb2.RebalanceRequest(force=True))
    (placement,) = [p for p in response.placements if p.instance_id == GROUP_ID]
    moved = sum(a != b for a, b in zip(before, placement.physical_to_logical, strict=True))
    assert moved > 0, "the rebalance kept every expert where it was"

    def applied() -> bool:  # a load report names the version running; reports need steps
        return (g := group_load(mesh)) is not None and g.applied_version >= placement.version

    rounds = 0
    while not applied():  # the same tokens while the swap is staged, done, and after
        assert rounds < 10, group_load(mesh)
        ids = prompts(4, salt=6 + rounds)
        got = asyncio.run(grpc_streams(mesh.grpc_address, [request(p, 6) for p in ids]))
        assert got == greedy(offline, ids, 6)
        rounds += 1
    swapped_s = time.monotonic() - asked
    ids = prompts(8, salt=20)
    got = asyncio.run(grpc_streams(mesh.grpc_address, [request(p, 6) for p in ids]))
    assert got == greedy(offline, ids, 6)
    assert_pages_return_to_zero_on(mesh, "prefill")
    every_rank_free(mesh)
    report(
        "ep_across_hosts",
        group_up_s=group_up,
        eplb_swap_applied_s=swapped_s,
        physical_slots_moved=float(moved),
    )


def test_an_ep_ranks_host_goes_dark(mesh: Mesh, offline: LLMEngine) -> None:
    """Node 1's cable is pulled: both nodes' groups exit non-zero (their links time out) and
    kv_broker drops every rank, so the gateway stops routing to them: a request sent then
    waits in the gateway's queue (no decode exists; docs/RELIABILITY.md, Migration) instead of
    going to a dead group. With the cable back the group, restarted, serves it and others."""
    dark_host = mesh.hosts["spare"]
    node0, node1 = mesh.services["decode"], mesh.services["decode-ep1"]
    dark_host.link_down()
    dark = time.monotonic()
    try:
        exited = wait_until(lambda: not node0.alive() and not node1.alive(), GROUP_FAILED_BOUND_S)
        group_failed = time.monotonic() - dark
        gone = wait_until(lambda: not decode_ranks(mesh), ROUTING_STOPPED_BOUND_S)
        routing_stopped = time.monotonic() - dark
        pool = ThreadPoolExecutor(1)
        waiting = pool.submit(
            lambda: asyncio.run(grpc_streams(mesh.grpc_address, [request([7, 8, 9], 5)]))
        )
        held = wait_until(lambda: waiting.done(), 3) is None  # neither served nor refused
    finally:
        dark_host.link_up()
    assert exited, mesh.log_tails()
    assert node0.process.returncode != 0 and node1.process.returncode != 0
    assert gone, [i.instance_id for i in decode_ranks(mesh)]
    assert held, waiting.result()

    back = time.monotonic()
    restarted = start_group(mesh)
    assert waiting.result(timeout=120) == greedy(offline, [[7, 8, 9]], 5)
    pool.shutdown()
    assert wait_until(lambda: len(decode_ranks(mesh)) == EP_SIZE, 60), mesh.log_tails()
    assert serves(mesh, offline), mesh.log_tails()
    serving = time.monotonic() - back
    ids = prompts(4, salt=8)
    got = asyncio.run(grpc_streams(mesh.grpc_address, [request(p, 6) for p in ids]))
    assert got == greedy(offline, ids, 6)
    assert_pages_return_to_zero_on(mesh, "prefill")
    every_rank_free(mesh)
    report(
        "ep_rank_host_dark",
        group_exited_s=group_failed,
        ranks_off_broker_list_s=routing_stopped,
        group_restarted_s=restarted,
        serving_after_link_up_s=serving,
    )
