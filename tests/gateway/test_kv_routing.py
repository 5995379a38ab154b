"""KV-aware routing: the gateway's copy of each instance's prefix cache, the policy that
scores instances by cached prefix against load, and a mesh of two unified instances where a
repeated prefix goes to the instance that holds it."""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator

import grpc
import pytest

from dsmesh.engine.kv.prefix_hashes import PrefixChanges, page_hashes
from dsmesh.gateway.admission import AdmissionQueue, MeshLoads, Ticket
from dsmesh.gateway.prefix_index import PrefixIndex, PromptPages
from dsmesh.gateway.routing import (
    LOAD,
    NO_PREFIX,
    PREFIX,
    PREFIX_OFF,
    DecodeLoad,
    PrefillLoad,
    PrefixHits,
    Target,
    choose_target,
)
from dsmesh.v1 import decode_pb2, decode_pb2_grpc, generation_pb2
from tests.gateway.kv_mesh import KVMesh, metric, running_kv_mesh, scrape

PROMPT = list(range(3, 3 + 40))  # 40 tokens: 9 full pages of 4 that a cache could serve

# ---- the index -------------------------------------------------------------------------------


def test_prompt_pages_leave_a_token_to_compute() -> None:
    pages = PromptPages(PROMPT)
    assert pages.names(4) == page_hashes(PROMPT[:39], 4)
    assert len(pages.names(4)) == 9 and len(pages.names(8)) == 4
    assert pages.names(4) is pages.names(4)  # computed once per page size


def test_index_follows_digests_and_counts_leading_pages() -> None:
    index = PrefixIndex()
    names = page_hashes(PROMPT, 4)
    assert index.cursor("u0") == (0, 0)
    index.apply("u0", PrefixChanges(7, 3, True, names[:3], []), page_size=4)
    assert index.cursor("u0") == (7, 3)
    assert index.cached_tokens("u0", PromptPages(PROMPT)) == 12
    index.apply("u0", PrefixChanges(7, 5, False, names[3:6], [names[1]]), page_size=4)
    # page 1 was evicted: only page 0 leads (pages 2.. are unreachable without it)
    assert index.cached_tokens("u0", PromptPages(PROMPT)) == 4
    index.apply("u0", PrefixChanges(7, 6, False, [names[1]], []), page_size=4)
    assert index.cached_tokens("u0", PromptPages(PROMPT)) == 24
    # a digest of another log (the instance restarted) replaces the copy
    index.apply("u0", PrefixChanges(9, 1, False, names[:1], []), page_size=4)
    assert index.cursor("u0") == (9, 1)
    assert index.cached_tokens("u0", PromptPages(PROMPT)) == 4
    # a prompt that differs in its second page shares only the first
    other = PROMPT[:4] + [t + 1 for t in PROMPT[4:]]
    index.apply("u1", PrefixChanges(2, 2, True, page_hashes(PROMPT, 8)[:4], []), page_size=8)
    assert index.cached_tokens("u1", PromptPages(PROMPT)) == 32
    assert index.cached_tokens("u1", PromptPages(other)) == 0
    assert index.hits(PromptPages(PROMPT), ["u0", "u1", "u2"]) == {"u0": 4, "u1": 32}
    index.retain(["u1"])
    assert index.cursor("u0") == (0, 0) and len(index) == 1
    index.forget("u1")
    assert index.hits(PromptPages(PROMPT), ["u1"]) == {}


# ---- the policy ------------------------------------------------------------------------------


def unified(instance_id: str, free_pages: int, running: int = 0) -> DecodeLoad:
    return DecodeLoad(instance_id, free_pages, 100, running, page_size=16)


def test_a_unified_instance_that_holds_the_prefix_wins_unless_far_busier() -> None:
    loads = [unified("u0", 50), unified("u1", 50)]
    assert choose_target([], [], loads, 100, 200) == Target("u0")  # load alone: a tie
    hits = PrefixHits({"u1": 64})
    target = choose_target([], [], loads, 100, 200, hits)
    assert target == Target("u1") and (target.cached_tokens, target.reason) == (64, PREFIX)
    # 64 cached tokens weigh as 64 free tokens: 4 pages more free on u0 make a tie (id wins)
    loads = [unified("u0", 54), unified("u1", 50)]
    assert choose_target([], [], loads, 100, 200, hits) == Target("u0")
    target = choose_target([], [], [unified("u0", 55), unified("u1", 50)], 100, 200, hits)
    assert target == Target("u0") and (target.cached_tokens, target.reason) == (0, LOAD)
    # the weight scales a cached token against a free one
    heavy = PrefixHits({"u1": 64}, weight=2.0)
    assert choose_target([], [], [unified("u0", 55), unified("u1", 50)], 100, 200, heavy) == (
        Target("u1")
    )
    # an instance without room is never chosen, however much it holds
    full = [unified("u0", 50), DecodeLoad("u1", 5, 100, 0, page_size=16)]
    target = choose_target([], [], full, 100, 200, PrefixHits({"u1": 96}))
    assert target == Target("u0") and target.reason == NO_PREFIX
    target = choose_target([], [], loads, 100, 200, PrefixHits({}))
    assert target.reason == NO_PREFIX
    assert choose_target([], [], loads, 100, 200).reason == PREFIX_OFF


def test_dp_ranks_of_an_ep_group_are_scored_separately() -> None:
    ranks = [unified("g-ep0", 50), unified("g-ep1", 50), unified("g-ep2", 50)]
    hits = PrefixHits({"g-ep0": 16, "g-ep2": 48})
    assert choose_target([], [], ranks, 100, 200, hits) == Target("g-ep2")


def test_a_prefill_that_holds_the_prefix_is_charged_only_what_it_computes() -> None:
    prefills = [PrefillLoad("p0", 100, 1), PrefillLoad("p1", 0, 0)]
    decodes = [DecodeLoad("d0", 50, 100, 0, page_size=16)]
    assert choose_target(prefills, decodes, [], 200, 300) == Target("d0", "p1")
    # p0 holds 160 of the prompt: 100 queued + 40 to compute beats 0 + 200
    target = choose_target(prefills, decodes, [], 200, 300, PrefixHits({"p0": 160}))
    assert target == Target("d0", "p0") and (target.cached_tokens, target.reason) == (160, PREFIX)
    busy = [PrefillLoad("p0", 500, 3), PrefillLoad("p1", 0, 0)]
    target = choose_target(busy, decodes, [], 200, 300, PrefixHits({"p0": 160}))
    assert target == Target("d0", "p1") and target.reason == LOAD
    # the decode holds no prefix: a unified instance's hit counts, a decode's load does
    mixed = choose_target(prefills, decodes, [unified("u0", 40)], 200, 300, PrefixHits({}))
    assert mixed == Target("d0", "p1")
    mixed = choose_target(prefills, decodes, [unified("u0", 40)], 200, 300, PrefixHits({"u0": 192}))
    assert mixed == Target("u0") and mixed.reason == PREFIX


def test_admission_routes_by_the_index_and_charges_the_whole_prompt() -> None:
    index = PrefixIndex()
    index.apply("p0", PrefixChanges(1, 1, True, page_hashes(PROMPT, 4)[:8], []), page_size=4)
    loads = MeshLoads(
        prefills=(PrefillLoad("p0", 10, 1), PrefillLoad("p1", 0, 0)),
        decodes=(DecodeLoad("d0", 100, 100, 0, page_size=4),),
        prefixes=index,
    )
    ticket = Ticket("r1", len(PROMPT), len(PROMPT) + 8, PromptPages(PROMPT))
    assert AdmissionQueue(8, 8).submit(ticket, loads, 0.0) == Target("d0", "p1")  # weight 0
    queue = AdmissionQueue(8, 8, prefix_weight=1.0)
    target = queue.submit(ticket, loads, 0.0)
    assert target == Target("d0", "p0") and target.cached_tokens == 32
    view = queue.ledger.corrected(loads)
    # prefill's queue bound counts whole prompts, cached or not: so does the ledger
    assert view.prefills[0].waiting_tokens == 10 + len(PROMPT)
    # without the prompt's pages (KV-aware routing off at the core), load alone
    plain = Ticket("r2", len(PROMPT), len(PROMPT) + 8)
    assert queue.submit(plain, loads, 0.0) == Target("d0", "p1")


# ---- on a mesh -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KVMesh]:
    with running_kv_mesh(
        2, tmp_path_factory.mktemp("kv-cache"), tmp_path_factory.mktemp("kv-logs")
    ) as m:
        yield m


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def generate(mesh: KVMesh, ids: list[int], new_tokens: int) -> dict:
    sampling = {"max_new_tokens": new_tokens, "ignore_eos": True, "temperature": 0}
    return post(f"{mesh.url}/v1/generate", {"input_ids": ids, "sampling": sampling})


def cached_pages(mesh: KVMesh) -> list[float]:
    return [
        metric(scrape(port), "dsmesh_prefix_cache_pages", 'role="unified"')
        for port in mesh.metrics_ports
    ]


def decode_directly(address: str, request_id: str, ids: list[int], new_tokens: int) -> None:
    """Run a request on one unified instance itself, past the gateway: it holds the prompt's
    pages afterwards."""
    sampling = generation_pb2.SamplingParams(
        max_new_tokens=new_tokens, ignore_eos=True, temperature=0
    )
    request = decode_pb2.DecodeRequest(request_id=request_id, input_ids=ids, sampling=sampling)
    with grpc.insecure_channel(address) as ch:
        replies = list(decode_pb2_grpc.DecodeStub(ch).Decode(request, timeout=120))
    assert sum(len(r.token_ids) for r in replies) == new_tokens


@pytest.mark.timeout(300)
def test_a_repeated_prefix_goes_to_the_instance_that_holds_it(mesh: KVMesh) -> None:
    a = [3 + (i * 7) % 200 for i in range(100)]  # 6 full pages of 16
    b = [3 + (i * 11) % 200 for i in range(100)]
    decode_directly(mesh.unified_addresses[0], "direct-a", a, 8)  # unified-0 holds A
    decode_directly(mesh.unified_addresses[1], "direct-b", b, 8)  # unified-1 holds B
    assert all(pages >= 6 for pages in cached_pages(mesh))
    time.sleep(1.5)  # the gateway polls each instance's prefix digest 4 times a second

    # Both instances are idle and alike: by load alone both follow-ups would go to unified-0
    # (a tie, the smaller id). Each goes to the instance that holds its 96 leading tokens.
    completion = post(
        f"{mesh.url}/v1/completions",
        {"model": mesh.model_dir.name, "prompt": b + [7, 8], "max_tokens": 4, "temperature": 0},
    )
    assert completion["usage"]["prompt_tokens_details"] == {"cached_tokens": 96}
    again = generate(mesh, a + [9], 4)
    assert again["usage"]["cached_tokens"] == 96
    hits = [
        metric(scrape(port), "dsmesh_prefix_cache_hit_tokens_total", 'role="unified"')
        for port in mesh.metrics_ports
    ]
    assert hits == [96, 96]
    gateway = scrape_gateway(mesh)
    assert metric(gateway, "dsmesh_routing_decisions_total", 'reason="prefix"') == 2
    assert metric(gateway, "dsmesh_prefix_cache_hit_tokens_total") == 192


def scrape_gateway(mesh: KVMesh) -> str:
    with urllib.request.urlopen(f"{mesh.url}/metrics", timeout=10) as resp:
        return resp.read().decode()
