"""The engine's sampling outputs end to end: logprobs per generated token (the same tokens as
without them, each at its own position), logit bias and penalties fed with the request's own
tokens, and n choices of one prompt sharing its KV through the prefix cache."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dsmesh.engine.errors import InvalidRequestError
from dsmesh.engine.llm_engine import EngineConfig, LLMEngine, StepOutput
from dsmesh.engine.model.build import load_model
from dsmesh.engine.model.tiny_model import make_tiny_model
from dsmesh.engine.sampling.params import SamplingParams
from dsmesh.engine.sampling.token_logprobs import TokenLogprobs


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory):
    folder: Path = make_tiny_model(tmp_path_factory.mktemp("tiny") / "v3", arch="v3")
    return load_model(folder)


def make_engine(model, **overrides) -> LLMEngine:
    return LLMEngine(EngineConfig(page_size=4, max_total_tokens=4096, **overrides), model=model)


def prompts(lengths: list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def run(
    engine: LLMEngine, prompt_list: list[list[int]], params: list[SamplingParams]
) -> list[tuple[list[int], list[TokenLogprobs] | None]]:
    """Every request's tokens and logprobs, gathered from the step outputs."""
    rids = [engine.add_request(p, sp) for p, sp in zip(prompt_list, params, strict=True)]
    outs: dict[str, list[StepOutput]] = {r: [] for r in rids}
    while engine.has_unfinished():
        for out in engine.step():
            outs[out.request_id].append(out)
    results = []
    for rid in rids:
        tokens = [t for o in outs[rid] for t in o.new_token_ids]
        with_tokens = [o for o in outs[rid] if o.new_token_ids]
        logprobs = None
        if all(o.logprobs is not None for o in with_tokens):
            logprobs = [lp for o in with_tokens for lp in o.logprobs or ()]
        results.append((tokens, logprobs))
    return results


def test_greedy_with_logprobs_gives_the_same_tokens(tiny_model) -> None:
    ps = prompts([3, 17, 40], tiny_model.config.vocab_size)
    plain = SamplingParams(max_new_tokens=10, ignore_eos=True)
    asking = SamplingParams(max_new_tokens=10, ignore_eos=True, logprobs=4)
    without = run(make_engine(tiny_model), ps, [plain] * 3)
    with_lp = run(make_engine(tiny_model), ps, [asking] * 3)
    for (tokens, none), (same, logprobs) in zip(without, with_lp, strict=True):
        assert none is None
        assert same == tokens
        assert logprobs is not None and len(logprobs) == len(tokens)
        for token, entry in zip(tokens, logprobs, strict=True):
            assert entry.token_id == token and entry.logprob <= 0
            assert len(entry.top) == 4
            assert entry.top[0] == (token, pytest.approx(entry.logprob))  # greedy: the top one
            values = [v for _, v in entry.top]
            assert values == sorted(values, reverse=True)


def test_each_logprob_belongs_to_its_position(tiny_model) -> None:
    """Token k's logprobs equal the first token's of a request whose prompt ends before it."""
    (prompt,) = prompts([9], tiny_model.config.vocab_size, seed=1)
    params = SamplingParams(max_new_tokens=6, ignore_eos=True, logprobs=3)
    ((tokens, logprobs),) = run(make_engine(tiny_model), [prompt], [params])
    assert logprobs is not None
    for k in (0, 2, 5):
        one = SamplingParams(max_new_tokens=1, ignore_eos=True, logprobs=3)
        ((first, (entry,)),) = run(make_engine(tiny_model), [prompt + tokens[:k]], [one])  # type: ignore[misc]
        assert first == [tokens[k]]
        assert entry.logprob == pytest.approx(logprobs[k].logprob, abs=1e-4)
        assert [t for t, _ in entry.top] == [t for t, _ in logprobs[k].top]


def test_logit_bias_forces_a_token(tiny_model) -> None:
    ps = prompts([5, 12], tiny_model.config.vocab_size, seed=2)
    forced = SamplingParams(
        max_new_tokens=6, ignore_eos=True, temperature=1.0, seed=3, logit_bias=((42, 100.0),)
    )
    results = run(make_engine(tiny_model), ps, [forced, SamplingParams(max_new_tokens=6)])
    assert results[0][0] == [42] * 6


def test_penalties_read_the_requests_own_tokens(tiny_model, monkeypatch) -> None:
    """The sampler gets each due request's prompt and output so far, row for row."""
    engine = make_engine(tiny_model, max_batch_tokens=8)  # the 20-token prompt takes 3 steps
    seen: list[tuple[list[int], list[int]]] = []
    real = engine.sampler

    def spy(logits, params, generators, prompt_ids=None, output_ids=None, allowed=None):
        assert prompt_ids is not None and output_ids is not None
        for p, prompt, output in zip(params, prompt_ids, output_ids, strict=True):
            if p.has_penalties:
                seen.append((list(prompt), list(output)))
        return real(logits, params, generators, prompt_ids, output_ids, allowed=allowed)

    monkeypatch.setattr(engine, "sampler", spy)
    ps = prompts([20, 4], tiny_model.config.vocab_size, seed=4)
    penalised = SamplingParams(max_new_tokens=5, ignore_eos=True, repetition_penalty=1.5)
    ((tokens, _), _) = run(engine, ps, [penalised, SamplingParams(max_new_tokens=5)])
    assert seen == [(ps[0], tokens[:k]) for k in range(5)]


def test_penalised_outputs_do_not_depend_on_the_batch(tiny_model) -> None:
    ps = prompts([6, 30, 11], tiny_model.config.vocab_size, seed=5)
    params = [
        SamplingParams(max_new_tokens=12, ignore_eos=True, frequency_penalty=1.5),
        SamplingParams(
            max_new_tokens=12, ignore_eos=True, presence_penalty=-1.0, seed=7, temperature=0.8
        ),
        SamplingParams(
            max_new_tokens=12, ignore_eos=True, repetition_penalty=1.3, logit_bias=((7, 3.0),)
        ),
    ]
    together = run(make_engine(tiny_model), ps, params)
    for p, sp, (tokens, _) in zip(ps, params, together, strict=True):
        assert run(make_engine(tiny_model), [p], [sp])[0][0] == tokens
    plain = run(
        make_engine(tiny_model), ps[:1], [SamplingParams(max_new_tokens=12, ignore_eos=True)]
    )
    assert together[0][0] != plain[0][0]  # the penalty changed the greedy output
    assert max(together[0][0].count(t) for t in set(together[0][0])) < max(
        plain[0][0].count(t) for t in set(plain[0][0])
    )


def test_n_choices_share_the_prompt_and_reproduce(tiny_model) -> None:
    """Choice 0 runs first; once it has a token, choices 1 and 2 (seeds + 1, + 2) find the
    prompt's full pages in the prefix cache, and every choice equals itself run alone."""
    (prompt,) = prompts([41], tiny_model.config.vocab_size, seed=6)
    choices = [
        SamplingParams(max_new_tokens=8, ignore_eos=True, temperature=1.0, seed=100 + i)
        for i in range(3)
    ]
    engine = make_engine(tiny_model, prefix_cache=True, max_batch_tokens=16)
    first = engine.add_request(prompt, choices[0])
    outs: dict[str, list[int]] = {first: []}
    while not outs[first]:
        for out in engine.step():
            outs[out.request_id] += out.new_token_ids
    cache = engine.scheduler.prefix_cache
    assert cache is not None
    hits_before = cache.stats().num_hit_tokens
    later = [engine.add_request(prompt, sp) for sp in choices[1:]]
    outs.update({r: [] for r in later})
    while engine.has_unfinished():
        for out in engine.step():
            outs[out.request_id] += out.new_token_ids
    assert cache.stats().num_hit_tokens - hits_before == 2 * 40  # 10 full pages each
    got = [outs[r] for r in (first, *later)]
    alone = [run(make_engine(tiny_model), [prompt], [sp])[0][0] for sp in choices]
    assert got == alone
    assert len({tuple(t) for t in got}) == 3  # independent seed streams
    assert engine.kv_pool.allocator.num_used_pages == cache.num_cached_pages


def test_logit_bias_outside_the_vocabulary_is_refused(tiny_model) -> None:
    engine = make_engine(tiny_model)
    vocab = tiny_model.config.vocab_size
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request([1, 2], SamplingParams(logit_bias=((vocab, 1.0),)))
    assert info.value.field == "sampling.logit_bias"


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@needs_cuda
def test_cuda_graphs_with_penalties_and_logprobs_equal_eager(tmp_path: Path) -> None:
    """On CUDA, decode steps with penalised, biased or logprob rows replay the graphs (the
    sampler runs after them) and give what the eager engine gives; a batch of plain greedy
    rows still launches ahead."""
    folder = make_tiny_model(tmp_path / "v3", arch="v3")
    base = EngineConfig(
        model=str(folder), device="cuda", dtype="float32", page_size=4, max_total_tokens=4096
    )
    eager = LLMEngine(EngineConfig(**{**base.__dict__, "cuda_graphs": False}))
    graphs = LLMEngine(base)
    assert graphs.graph_runner is not None and eager.graph_runner is None
    vocab = graphs.model_config.vocab_size
    ps = prompts([5, 19, 33, 8, 12], vocab, seed=8)
    params = [
        SamplingParams(max_new_tokens=12, ignore_eos=True),
        SamplingParams(max_new_tokens=12, ignore_eos=True, logprobs=5),
        SamplingParams(
            max_new_tokens=12, ignore_eos=True, frequency_penalty=1.0, repetition_penalty=1.2
        ),
        SamplingParams(
            max_new_tokens=12,
            ignore_eos=True,
            temperature=0.8,
            seed=9,
            presence_penalty=0.5,
            logit_bias=((3, 2.0),),
            logprobs=1,
        ),
        SamplingParams(max_new_tokens=12, ignore_eos=True, logit_bias=((11, 100.0),)),
    ]
    want = run(eager, ps, params)
    got = run(graphs, ps, params)
    for sp, (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(params, got, want, strict=True):
        assert tokens == ref_tokens
        if sp.logprobs is None:
            assert logprobs is None and ref_logprobs is None
            continue
        assert logprobs is not None and ref_logprobs is not None
        assert [e.logprob for e in logprobs] == pytest.approx(
            [e.logprob for e in ref_logprobs], abs=1e-4
        )
    assert got[4][0] == [11] * 12
    assert graphs.num_launched_ahead == 0  # every batch had a row that needs the sampler
    plain = [SamplingParams(max_new_tokens=12, ignore_eos=True)] * 3
    assert run(graphs, ps[:3], plain) == run(eager, ps[:3], plain)
    assert graphs.num_launched_ahead > 0
