"""KV-aware routing of the decode half of a pair: a decode that kept an earlier turn of the
conversation in its prefix cache is scored by the prefix it holds against load, as a unified
instance is, so a follow-up turn goes back to it (pure policy, no processes)."""

from __future__ import annotations

from dsmesh.engine.kv.prefix_hashes import PrefixChanges, page_hashes
from dsmesh.gateway.admission import AdmissionQueue, MeshLoads, Ticket
from dsmesh.gateway.prefix_index import PrefixIndex, PromptPages
from dsmesh.gateway.routing import (
    NO_PREFIX,
    PREFIX,
    DecodeLoad,
    PrefillLoad,
    PrefixHits,
    Target,
    choose_target,
)

PROMPT = list(range(3, 3 + 40))  # 40 tokens: 9 full pages of 4 that a cache could serve


def decode(instance_id: str, free_pages: int, running: int = 0) -> DecodeLoad:
    return DecodeLoad(instance_id, free_pages, 100, running, page_size=16)


PREFILLS = [PrefillLoad("p0", 0, 0)]


def test_the_decode_that_holds_the_prefix_wins_unless_far_busier() -> None:
    decodes = [decode("d0", 50), decode("d1", 50)]
    assert choose_target(PREFILLS, decodes, [], 100, 200) == Target("d0", "p0")  # a tie
    target = choose_target(PREFILLS, decodes, [], 100, 200, PrefixHits({"d1": 64}))
    # the reason and cached tokens are the prefill's: it holds none of this prompt
    assert target == Target("d1", "p0") and (target.cached_tokens, target.reason) == (0, NO_PREFIX)
    # 64 cached tokens weigh as 64 free ones: 4 more free pages on d0 tie (the id wins), 5 win
    busier = [decode("d0", 54), decode("d1", 50)]
    assert choose_target(PREFILLS, busier, [], 100, 200, PrefixHits({"d1": 64})).instance_id == (
        "d0"
    )
    heavy = PrefixHits({"d1": 64}, weight=2.0)
    assert choose_target(PREFILLS, busier, [], 100, 200, heavy) == Target("d1", "p0")
    # a decode without room is never chosen, however much it holds
    full = [decode("d0", 50), decode("d1", 5)]
    assert choose_target(PREFILLS, full, [], 100, 200, PrefixHits({"d1": 96})).instance_id == "d0"


def test_prefill_and_decode_are_each_scored_by_what_each_holds() -> None:
    prefills = [PrefillLoad("p0", 0, 0), PrefillLoad("p1", 0, 0)]
    decodes = [decode("d0", 50), decode("d1", 50)]
    target = choose_target(prefills, decodes, [], 100, 200, PrefixHits({"p1": 48, "d1": 96}))
    assert target == Target("d1", "p1") and (target.cached_tokens, target.reason) == (48, PREFIX)


def test_admission_looks_up_the_decodes_in_the_index() -> None:
    index = PrefixIndex()
    index.apply("d1", PrefixChanges(1, 1, True, page_hashes(PROMPT, 4)[:8], []), page_size=4)
    loads = MeshLoads(
        prefills=(PrefillLoad("p0", 0, 0),),
        decodes=(
            DecodeLoad("d0", 100, 100, 0, page_size=4),
            DecodeLoad("d1", 100, 100, 0, page_size=4),
        ),
        prefixes=index,
    )
    ticket = Ticket("r1", len(PROMPT), len(PROMPT) + 8, PromptPages(PROMPT))
    assert AdmissionQueue(8, 8).submit(ticket, loads, 0.0) == Target("d0", "p0")  # weight 0
    routed = AdmissionQueue(8, 8, prefix_weight=1.0).submit(ticket, loads, 0.0)
    assert routed == Target("d1", "p0")
