"""The offline engine: continuous batching, chunked prefill, stopping, pages, bad input."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dsmesh.engine.errors import InvalidRequestError
from dsmesh.engine.kv.pool import OutOfPagesError
from dsmesh.engine.llm_engine import EngineConfig, LLMEngine
from dsmesh.engine.model.build import load_model
from dsmesh.engine.model.tiny_model import make_tiny_model
from dsmesh.engine.sampling.params import SamplingParams

GREEDY16 = SamplingParams(max_new_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "v3", arch="v3")


@pytest.fixture(scope="module")
def tiny_model(tiny_dir: Path):
    return load_model(tiny_dir)


def make_engine(model, **overrides) -> LLMEngine:
    cfg = EngineConfig(page_size=4, max_total_tokens=4096, **overrides)
    return LLMEngine(cfg, model=model)


def prompts(lengths: list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def run_alone(model, prompt: list[int], params: SamplingParams = GREEDY16) -> list[int]:
    return make_engine(model).generate([prompt], params)[0].output_ids


def test_batch_equals_each_alone_and_frees_pages(tiny_model) -> None:
    ps = prompts([1, 3, 17, 64, 100], tiny_model.config.vocab_size)
    engine = make_engine(tiny_model)
    together = [r.output_ids for r in engine.generate(ps, GREEDY16)]
    alone = [run_alone(tiny_model, p) for p in ps]
    assert together == alone
    assert all(len(o) == 16 for o in together)
    assert len({tuple(o) for o in together}) > 1  # outputs depend on the prompt
    assert engine.kv_pool.allocator.num_used_pages == 0


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_prefill_matches_one_shot(tiny_model, chunk: int) -> None:
    (prompt,) = prompts([100], tiny_model.config.vocab_size, seed=3)
    one_shot = make_engine(tiny_model, max_batch_tokens=4096).generate([prompt], GREEDY16)
    chunked_engine = make_engine(tiny_model, max_batch_tokens=chunk)
    # The first step may only take `chunk` prompt tokens: prefill really is split.
    chunked_engine.add_request(prompt, GREEDY16, request_id="r")
    chunked_engine.step()
    assert chunked_engine.requests["r"].num_computed == min(chunk, len(prompt))
    while chunked_engine.has_unfinished():
        chunked_engine.step()
    chunked = make_engine(tiny_model, max_batch_tokens=chunk).generate([prompt], GREEDY16)
    assert chunked[0].output_ids == one_shot[0].output_ids


def test_requests_joining_mid_way_match_running_alone(tiny_model) -> None:
    ps = prompts([5, 40, 2, 77], tiny_model.config.vocab_size, seed=5)
    engine = make_engine(tiny_model, max_batch_tokens=32)
    outputs: dict[str, list[int]] = {}
    join_at = {0: [0], 3: [1], 6: [2, 3]}  # step -> prompts that arrive then
    step = 0
    while step in join_at or engine.has_unfinished() or step <= max(join_at):
        for i in join_at.get(step, []):
            engine.add_request(ps[i], GREEDY16, request_id=f"p{i}")
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        step += 1
    for i, p in enumerate(ps):
        assert outputs[f"p{i}"] == run_alone(tiny_model, p), f"prompt {i}"
    assert engine.kv_pool.allocator.num_used_pages == 0


def test_naive_and_absorbed_decode_agree(tiny_model) -> None:
    ps = prompts([9, 30], tiny_model.config.vocab_size, seed=11)
    outs = {
        mode: [
            r.output_ids
            for r in make_engine(tiny_model, attention_mode=mode).generate(ps, GREEDY16)
        ]
        for mode in ("naive", "absorbed", "auto")
    }
    assert outs["naive"] == outs["absorbed"] == outs["auto"]


def test_seeded_sampling_is_reproducible_and_batch_independent(tiny_model) -> None:
    ps = prompts([6, 20, 33], tiny_model.config.vocab_size, seed=2)
    sampled = SamplingParams(
        temperature=1.0, top_p=0.9, max_new_tokens=12, seed=1234, ignore_eos=True
    )
    mixed = [sampled, GREEDY16, SamplingParams(temperature=0.7, seed=99, max_new_tokens=12)]
    batch = make_engine(tiny_model).generate(ps, mixed)
    assert batch[0].output_ids == run_alone(tiny_model, ps[0], sampled)
    assert batch[1].output_ids == run_alone(tiny_model, ps[1], GREEDY16)
    other_seed = SamplingParams(
        temperature=1.0, top_p=0.9, max_new_tokens=12, seed=4321, ignore_eos=True
    )
    assert run_alone(tiny_model, ps[0], other_seed) != batch[0].output_ids


def test_stop_conditions(tiny_model) -> None:
    (p,) = prompts([12], tiny_model.config.vocab_size, seed=8)
    free_run = run_alone(tiny_model, p)
    stop_tok = free_run[5]
    first = free_run.index(stop_tok)
    res = make_engine(tiny_model).generate(
        [p], SamplingParams(max_new_tokens=16, stop_token_ids=(stop_tok,))
    )[0]
    assert res.output_ids == free_run[: first + 1]
    assert res.finish_reason == "stop"
    res = make_engine(tiny_model).generate([p], SamplingParams(max_new_tokens=3))[0]
    assert res.finish_reason in ("length", "stop") and len(res.output_ids) <= 3


def test_eos_stops_unless_ignored(tiny_dir: Path, tiny_model) -> None:
    (p,) = prompts([12], tiny_model.config.vocab_size, seed=8)
    free_run = run_alone(tiny_model, p)
    # Make the model's own 4th greedy token the EOS id by loading it with a config whose
    # eos_token_id is that token: generation must stop right there unless ignore_eos.
    import dataclasses

    cfg = dataclasses.replace(tiny_model.config, eos_token_ids=(free_run[3],))
    model = load_model(tiny_dir)
    model.config = cfg
    first = free_run.index(free_run[3])
    res = make_engine(model).generate([p], SamplingParams(max_new_tokens=16))[0]
    assert res.output_ids == free_run[: first + 1] and res.finish_reason == "stop"
    res = make_engine(model).generate([p], SamplingParams(max_new_tokens=16, ignore_eos=True))[0]
    assert res.output_ids == free_run and res.finish_reason == "length"


def test_context_limit_finishes_with_length(tiny_dir: Path) -> None:
    import dataclasses

    model = load_model(tiny_dir)
    model.config = dataclasses.replace(model.config, max_position_embeddings=20)
    (p,) = prompts([15], model.config.vocab_size)
    res = make_engine(model).generate([p], SamplingParams(max_new_tokens=100, ignore_eos=True))[0]
    assert len(p) + len(res.output_ids) == 20 and res.finish_reason == "length"


def test_admission_waits_for_pages_and_never_leaks(tiny_model) -> None:
    # 6 pages of 4 tokens: a request takes ceil(10 / 4) = 3 pages for its prompt and grows to
    # ceil((10 + 6) / 4) = 4. A second one would leave the first no page to grow into
    # (admission keeps one free per running request), so only one runs at a time; the others
    # wait in the queue rather than fail, and none is ever retracted.
    engine = LLMEngine(EngineConfig(page_size=4, max_total_tokens=24), model=tiny_model)
    ps = prompts([10, 10, 10], tiny_model.config.vocab_size, seed=4)
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    for i, p in enumerate(ps):
        engine.add_request(p, params, request_id=f"r{i}")
    engine.step()
    assert len(engine.scheduler.running) == 1 and len(engine.scheduler.waiting) == 2
    assert engine.kv_pool.allocator.num_used_pages == 3
    while engine.has_unfinished():
        engine.step()
        assert len(engine.scheduler.running) <= 1
        assert engine.kv_pool.allocator.num_used_pages <= 4
    assert engine.kv_pool.allocator.num_used_pages == 0
    assert engine.stats.num_retractions == 0
    with pytest.raises(OutOfPagesError):
        engine.kv_pool.allocator.allocate(7)
    assert engine.kv_pool.allocator.num_free_pages == 6


def test_abort_frees_pages(tiny_model) -> None:
    engine = make_engine(tiny_model)
    ps = prompts([30, 30], tiny_model.config.vocab_size)
    engine.add_request(ps[0], GREEDY16, request_id="a")
    engine.add_request(ps[1], GREEDY16, request_id="b")
    engine.step()
    used = engine.kv_pool.allocator.num_used_pages
    assert used > 0
    assert engine.abort("a") is True
    assert engine.abort("a") is False
    assert engine.kv_pool.allocator.num_used_pages < used
    while engine.has_unfinished():
        engine.step()
    assert engine.kv_pool.allocator.num_used_pages == 0


@pytest.mark.parametrize(
    ("prompt", "params", "field"),
    [
        ([], GREEDY16, "input_ids"),
        ([1, 2, 10**6], GREEDY16, "input_ids"),
        ([1, -1], GREEDY16, "input_ids"),
        ([1] * 4096, GREEDY16, "input_ids"),  # the tiny model's context is 4096
        ([1, 2], SamplingParams(temperature=-1.0), "sampling.temperature"),
        ([1, 2], SamplingParams(top_p=0.0), "sampling.top_p"),
        ([1, 2], SamplingParams(max_new_tokens=0), "sampling.max_new_tokens"),
        ([1, 2], SamplingParams(max_new_tokens=10**6), "sampling.max_new_tokens"),
    ],
)
def test_bad_input_names_the_field(tiny_model, prompt, params, field) -> None:
    engine = LLMEngine(EngineConfig(page_size=4, max_total_tokens=2048), model=tiny_model)
    with pytest.raises(InvalidRequestError) as err:
        engine.add_request(prompt, params)
    assert err.value.field == field
    assert field.split(".")[-1] in str(err.value)
    assert not engine.has_unfinished()
