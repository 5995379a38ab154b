"""What an engine instance reports about its prefix cache: the page names a ``GetLoad`` asks
for (a reader follows them from its cursor), each request's cached prompt tokens, and the
cache's and scheduler's counters on ``/metrics``."""

from __future__ import annotations

import pytest
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from dsmesh.engine.kv.prefix_hashes import page_hashes
from dsmesh.engine.llm_engine import EngineConfig, LLMEngine
from dsmesh.engine.sampling.params import SamplingParams
from dsmesh.instance.metrics import InstanceMetrics
from dsmesh.instance.prefixes import prefix_digest
from dsmesh.v1 import prefill_pb2

GREEDY = SamplingParams(max_new_tokens=4, ignore_eos=True)
PROMPT = [3 + (i * 5) % 300 for i in range(40)]


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine(EngineConfig(page_size=4, max_total_tokens=1024, prefix_cache=True))


def samples(metrics: InstanceMetrics, role: str = "unified") -> dict[str, float]:
    text = generate_latest(metrics.registry).decode()
    return {
        s.name: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.labels == {"role": role}
    }


def test_digest_cached_tokens_and_metrics(engine: LLMEngine) -> None:
    plain = prefill_pb2.LoadRequest()
    assert prefix_digest(engine, plain) is None  # not asked for
    first = prefix_digest(engine, prefill_pb2.LoadRequest(prefixes={}))
    assert first is not None and first.reset and list(first.stored) == []
    assert first.page_size == 4 and first.epoch != 0

    rid = engine.add_request(PROMPT, GREEDY)
    req = engine.requests[rid]
    while engine.has_unfinished():
        engine.step()
    assert req.num_cached_prompt_tokens == 0
    cursor = prefill_pb2.PrefixCursor(epoch=first.epoch, seq=first.seq)
    later = prefix_digest(engine, prefill_pb2.LoadRequest(prefixes=cursor))
    assert later is not None and not later.reset and list(later.removed) == []
    # prompt and output computed: 43 tokens, 10 full pages
    assert set(later.stored) == set(page_hashes(PROMPT + req.output_ids, 4)[:10])

    again = engine.add_request(PROMPT + [7], GREEDY)
    req = engine.requests[again]
    while engine.has_unfinished():
        engine.step()
    assert req.num_cached_prompt_tokens == 40  # 10 pages of 4: the first prompt's

    got = samples(InstanceMetrics(engine, "unified"))
    assert got["dsmesh_prefix_cache_lookup_tokens_total"] == 40 + 41
    assert got["dsmesh_prefix_cache_hit_tokens_total"] == 40
    assert got["dsmesh_prefix_cache_hit_rate"] == pytest.approx(40 / 81)
    assert got["dsmesh_prefix_cache_pages"] >= 10
    assert got["dsmesh_prefix_cache_evicted_pages_total"] == 0
    assert got["dsmesh_prefix_waits_total"] == 0  # one request at a time: none waited
    assert got["dsmesh_retractions_total"] == 0 == got["dsmesh_retracted_tokens_total"]


def test_without_a_prefix_cache_only_retractions_show() -> None:
    engine = LLMEngine(EngineConfig(page_size=4, max_total_tokens=256))
    assert prefix_digest(engine, prefill_pb2.LoadRequest(prefixes={})) is None
    got = samples(InstanceMetrics(engine, "unified"))
    assert "dsmesh_retractions_total" in got
    assert not any(name.startswith(("dsmesh_prefix_cache", "dsmesh_prefix_waits")) for name in got)


def test_decode_reports_its_line_for_pages(engine: LLMEngine) -> None:
    line = [1, 2, 3]
    got = samples(InstanceMetrics(engine, "decode", in_line=lambda: len(line)), "decode")
    assert got["dsmesh_requests_in_line"] == 3
    assert "dsmesh_requests_in_line" not in samples(InstanceMetrics(engine, "unified"))
