"""Prompt logprobs computed during prefill equal transformers' log_softmax of the prompt's
logits, whatever the chunking; a request owing them takes no prefix-cache hit; and
min_tokens masks EOS and stop token ids until that many tokens are out."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dsmesh.engine.llm_engine import EngineConfig, LLMEngine, StepOutput
from dsmesh.engine.model.build import load_model
from dsmesh.engine.sampling.params import SamplingParams
from dsmesh.engine.sampling.prompt_logprobs import prompt_logprobs_ref, score_tokens
from dsmesh.engine.sampling.token_logprobs import TokenLogprobs
from tests.engine.hf_checkpoints import HFCheckpoint, hf_logits, random_prompts


def make_engine(ckpt: HFCheckpoint, **overrides) -> LLMEngine:
    config = EngineConfig(
        model=str(ckpt.path), device="cpu", dtype="float32", page_size=4, max_total_tokens=2048
    )
    return LLMEngine(dataclasses.replace(config, **overrides))


def run(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> list[StepOutput]:
    rid = engine.add_request(prompt, params)
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.request_id == rid]
    return outs


def prompt_entries(outs: list[StepOutput]) -> list[TokenLogprobs]:
    return [e for o in outs for e in o.prompt_logprobs or ()]


def assert_close(ours: list[TokenLogprobs], ref: list[TokenLogprobs]) -> None:
    assert [e.token_id for e in ours] == [e.token_id for e in ref]
    for a, b in zip(ours, ref, strict=True):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
        assert [v for _, v in a.top] == pytest.approx([v for _, v in b.top], abs=1e-4)


@pytest.mark.parametrize("batch_tokens", [7, 64])
def test_prompt_logprobs_equal_transformers(v3_ckpt, batch_tokens) -> None:
    """A 30-token prompt in chunks of 7 (5 forwards) or in one: every token after the first,
    each with its 3 most likely alternatives, as transformers' log_softmax gives them."""
    (prompt,) = random_prompts([30], v3_ckpt.hf_model.config.vocab_size, seed=3)
    engine = make_engine(v3_ckpt, max_batch_tokens=batch_tokens)
    params = SamplingParams(max_new_tokens=2, ignore_eos=True, prompt_logprobs=3)
    outs = run(engine, prompt, params)
    ref = prompt_logprobs_ref(hf_logits(v3_ckpt.hf_model, prompt), prompt, 3)
    assert len(prompt_entries(outs)) == len(prompt) - 1
    assert_close(prompt_entries(outs), ref)
    # the generated tokens are those of a request without prompt logprobs
    plain = run(engine, prompt, SamplingParams(max_new_tokens=2, ignore_eos=True))
    assert [t for o in outs for t in o.new_token_ids] == [t for o in plain for t in o.new_token_ids]


def test_score_tokens_in_slices_equals_all_at_once(v3_ckpt) -> None:
    """Logits materialised 3 rows at a time give what the whole [n, vocab] gives."""
    model = load_model(v3_ckpt.path, torch.float32, torch.device("cpu"))
    hidden = torch.randn(10, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    targets = list(range(5, 15))
    whole = score_tokens(model.compute_logits, hidden, targets, 2, rows_at_once=10)
    sliced = score_tokens(model.compute_logits, hidden, targets, 2, rows_at_once=3)
    assert_close(sliced, whole)


def test_a_request_owing_prompt_logprobs_skips_the_prefix_cache(v3_ckpt) -> None:
    (prompt,) = random_prompts([21], v3_ckpt.hf_model.config.vocab_size, seed=4)
    engine = make_engine(v3_ckpt, prefix_cache=True, max_batch_tokens=8)
    run(engine, prompt, SamplingParams(max_new_tokens=1))  # its full pages go to the cache
    scoring = SamplingParams(max_new_tokens=1, prompt_logprobs=0)
    rid = engine.add_request(prompt, scoring)
    req = engine.requests[rid]
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.request_id == rid]
    assert req.num_cached_prompt_tokens == 0
    ref = prompt_logprobs_ref(hf_logits(v3_ckpt.hf_model, prompt), prompt, 0)
    assert_close(prompt_entries(outs), ref)
    again = engine.add_request(prompt, SamplingParams(max_new_tokens=1))
    cached = engine.requests[again]
    while engine.has_unfinished():
        engine.step()
    assert cached.num_cached_prompt_tokens == 20  # five full pages of 4


def test_one_token_prompt_has_no_prompt_logprobs(v3_ckpt) -> None:
    outs = run(make_engine(v3_ckpt), [5], SamplingParams(max_new_tokens=1, prompt_logprobs=2))
    assert prompt_entries(outs) == []


def test_min_tokens_masks_eos_and_stop_token_ids(v3_ckpt) -> None:
    """A logit bias makes EOS (or a stop token) the greedy choice at every step: without
    min_tokens the request stops at once; with it, exactly at its min_tokens-th + 1 token."""
    engine = make_engine(v3_ckpt)
    (eos,) = engine.model_config.eos_token_ids[:1]
    (prompt,) = random_prompts([6], v3_ckpt.hf_model.config.vocab_size, seed=5)

    def tokens(**kw) -> tuple[list[int], str | None]:
        outs = run(engine, prompt, SamplingParams(max_new_tokens=10, **kw))
        return [t for o in outs for t in o.new_token_ids], outs[-1].finish_reason

    to_eos = ((eos, 100.0),)
    assert tokens(logit_bias=to_eos) == ([eos], "stop")
    out, reason = tokens(logit_bias=to_eos, min_tokens=4)
    assert len(out) == 5 and eos not in out[:4] and out[4] == eos and reason == "stop"
    # ignore_eos: EOS is not a stop token, so min_tokens does not mask it
    assert tokens(logit_bias=to_eos, min_tokens=4, ignore_eos=True)[0] == [eos] * 10
    stop = (eos + 1) % v3_ckpt.hf_model.config.vocab_size
    out, reason = tokens(logit_bias=((stop, 100.0),), stop_token_ids=(stop,), min_tokens=3)
    assert len(out) == 4 and stop not in out[:3] and out[3] == stop and reason == "stop"
    # sampled rows too: the masked tokens have no probability
    out, _ = tokens(logit_bias=to_eos, min_tokens=6, temperature=1.0, seed=1)
    assert eos not in out[:6] and out[6] == eos


def test_min_tokens_logprobs_show_the_raw_distribution(v3_ckpt) -> None:
    engine = make_engine(v3_ckpt)
    (prompt,) = random_prompts([6], v3_ckpt.hf_model.config.vocab_size, seed=6)
    raw = run(engine, prompt, SamplingParams(max_new_tokens=1, ignore_eos=True, logprobs=1))
    (first,) = raw[-1].logprobs or ()
    stop = first.token_id  # the greedy token: masked under min_tokens, still reported as top
    masked = run(
        engine,
        prompt,
        SamplingParams(max_new_tokens=1, stop_token_ids=(stop,), min_tokens=1, logprobs=1),
    )
    (entry,) = masked[-1].logprobs or ()
    assert entry.token_id != stop
    assert entry.top[0][0] == stop and entry.top[0][1] == pytest.approx(first.logprob, abs=1e-5)


def test_a_retracted_request_scores_each_prompt_token_once(v3_ckpt) -> None:
    """Retracted after its first chunk, the request recomputes its prompt (skipping the
    cache, since it still owes logprobs) and reports the rest: every token once, in order."""
    (prompt,) = random_prompts([30], v3_ckpt.hf_model.config.vocab_size, seed=7)
    engine = make_engine(v3_ckpt, prefix_cache=True, max_batch_tokens=8)
    rid = engine.add_request(prompt, SamplingParams(max_new_tokens=2, prompt_logprobs=1))
    req = engine.requests[rid]
    outs = [o for o in engine.step() if o.request_id == rid]
    assert len(prompt_entries(outs)) == 8 and req.num_prompt_scored == 8
    engine.scheduler.retract(req)
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.request_id == rid]
    assert engine.stats.num_retractions == 1
    ref = prompt_logprobs_ref(hf_logits(v3_ckpt.hf_model, prompt), prompt, 1)
    assert_close(prompt_entries(outs), ref)
