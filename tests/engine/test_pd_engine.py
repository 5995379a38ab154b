"""The engine halves of PD disaggregation, in one process: a prefill-only engine computes the
prompt and samples the first token; its KV pages are copied into pages a decode engine
reserved; the decode engine continues. Tokens equal the offline engine's."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dsmesh.engine.kv.pool import OutOfPagesError
from dsmesh.engine.llm_engine import EngineConfig, LLMEngine
from dsmesh.engine.model.build import load_model
from dsmesh.engine.model.tiny_model import make_tiny_model
from dsmesh.engine.request import Request
from dsmesh.engine.sampling.params import SamplingParams


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory):
    return load_model(make_tiny_model(tmp_path_factory.mktemp("tiny") / "m"))


def prefill_into(prefill: LLMEngine, decode: LLMEngine, reserved: Request) -> int:
    """Prefill ``reserved``'s prompt, copy its KV into the pages decode reserved, release
    prefill's pages; returns the first token."""
    rid, prompt = reserved.request_id, reserved.prompt_ids
    prefill.add_request(prompt, reserved.params, request_id=rid, prefill_only=True)
    first = None
    while first is None:
        for out in prefill.step():
            if out.request_id == rid and out.finished:
                assert out.finish_reason == "prefilled"
                first = out.new_token_ids[0]
    src = prefill.requests[rid]
    n_pages = -(-len(prompt) // prefill.config.page_size)
    for i in range(n_pages):  # all layers of each prompt page
        decode.kv_pool.buffer[:, reserved.pages[i]] = prefill.kv_pool.buffer[:, src.pages[i]]
    prefill.release(rid)
    return first


def handoff(prefill: LLMEngine, decode: LLMEngine, prompt, params, rid: str) -> list[int]:
    reserved = decode.reserve(prompt, params, rid)
    first = prefill_into(prefill, decode, reserved)
    tokens = list(decode.activate(rid, first).new_token_ids)
    while rid in decode.requests:
        for out in decode.step():
            if out.request_id == rid:
                tokens += out.new_token_ids
    return tokens


@pytest.mark.parametrize("page_size", [1, 16])
def test_prefill_then_decode_equals_offline(model, page_size: int) -> None:
    cfg = EngineConfig(page_size=page_size, max_total_tokens=4096, max_batch_tokens=32)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 500, (n,), generator=g).tolist() for n in (1, 15, 70)]
    params = [
        SamplingParams(max_new_tokens=10, ignore_eos=True),
        SamplingParams(max_new_tokens=10, ignore_eos=True, temperature=0.9, seed=3),
        SamplingParams(max_new_tokens=1),
    ]
    offline = LLMEngine(cfg, model=model).generate(prompts, params)
    prefill = LLMEngine(EngineConfig(**{**cfg.__dict__, "prefix_cache": True}), model=model)
    decode = LLMEngine(cfg, model=model)
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        assert handoff(prefill, decode, p, sp, f"r{i}") == offline[i].output_ids
    assert prefill.num_pages_in_use == 0 and decode.num_pages_in_use == 0


def test_reserve_raises_when_out_of_pages(model) -> None:
    decode = LLMEngine(EngineConfig(page_size=4, max_total_tokens=16), model=model)
    # the prompt's 2 of 4 pages; b's 2 would leave a none to grow into
    decode.reserve([1] * 8, SamplingParams(max_new_tokens=4), "a")
    with pytest.raises(OutOfPagesError):
        decode.reserve([1] * 8, SamplingParams(max_new_tokens=4), "b")
    assert decode.abort("a") is True
    assert decode.num_pages_in_use == 0
    decode.reserve([1] * 8, SamplingParams(max_new_tokens=4), "b")
    decode.release("b")
    assert decode.num_pages_in_use == 0


def test_a_decode_pool_too_small_for_the_batch_gives_the_offline_tokens(model) -> None:
    """Requests handed off into a decode pool that holds a few at a time: each reserves its
    prompt's pages in its turn (the others wait, as in decode's line), grows as it decodes,
    and the newest are retracted and recompute on decode. Every token comes once, as an
    unlimited pool gives it."""
    cfg = EngineConfig(page_size=4, max_total_tokens=4096, max_batch_tokens=32)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 500, (n,), generator=g).tolist() for n in (5, 12, 3, 9, 14)]
    params = [SamplingParams(max_new_tokens=20 + 2 * i, ignore_eos=True) for i in range(5)]
    params[1] = SamplingParams(max_new_tokens=20, temperature=0.9, seed=5, ignore_eos=True)
    offline = LLMEngine(cfg, model=model).generate(prompts, params)
    prefill = LLMEngine(cfg, model=model)
    decode = LLMEngine(dataclasses.replace(cfg, max_total_tokens=48), model=model)  # 12 pages
    assert sum(len(p) + sp.max_new_tokens for p, sp in zip(prompts, params, strict=True)) > 3 * 48
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    line = list(range(len(prompts)))  # waiting for decode's pages, in arrival order
    while line or decode.has_unfinished():
        while line:
            i = line[0]
            try:
                reserved = decode.reserve(prompts[i], params[i], f"r{i}")
            except OutOfPagesError:
                break
            line.pop(0)
            first = prefill_into(prefill, decode, reserved)
            tokens[f"r{i}"] += decode.activate(f"r{i}", first).new_token_ids
        for out in decode.step():
            tokens[out.request_id] += out.new_token_ids
    assert list(tokens.values()) == [r.output_ids for r in offline]
    assert decode.stats.num_retractions > 0  # the pool really was short
    assert decode.num_pages_in_use == 0 and prefill.num_pages_in_use == 0
