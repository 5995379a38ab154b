"""Overlapped decode: a greedy decode step launches the next one (fed its tokens on the
device) before its own bookkeeping. Stop tokens, aborts, sampled rows (and greedy rows with
penalties, logit bias or logprobs) and length limits around a step launched ahead must leave
the tokens and the KV pages exactly as without it.

On CPU the graph runner runs without graphs (each launch computes at once), which exercises
the engine's bookkeeping; the GPU tests and dsmesh/bench/gpu.py run it with real graphs."""

from __future__ import annotations

import dataclasses

import pytest

from dsmesh.engine.llm_engine import EngineConfig, LLMEngine
from dsmesh.engine.runner.cuda_graph import CudaGraphRunner
from dsmesh.engine.sampling.params import SamplingParams
from tests.engine.hf_checkpoints import HFCheckpoint, random_prompts

LENGTHS = [3, 9, 17, 30]


def _engine(ckpt: HFCheckpoint, overlap: bool, max_total_tokens: int = 1024) -> LLMEngine:
    cfg = EngineConfig(
        model=str(ckpt.path),
        device="cpu",
        dtype="float32",
        page_size=4,
        max_total_tokens=max_total_tokens,
        overlap_decode=overlap,
    )
    engine = LLMEngine(cfg)
    engine.graph_runner = CudaGraphRunner(
        engine.model, engine.kv_pool, max_batch=8, max_tokens_per_request=256, use_graphs=False
    )
    return engine


def _run(engine: LLMEngine, params: list[SamplingParams], abort_at: dict[int, int] | None = None):
    """Every prompt at once; ``abort_at`` {request index: step} aborts after that step.
    Returns (tokens per request, finish reason per request)."""
    prompts = random_prompts(LENGTHS, engine.model_config.vocab_size, seed=3)
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    out: dict[str, list[int]] = {i: [] for i in ids}
    reasons: dict[str, str | None] = {i: None for i in ids}
    step = 0
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id].extend(o.new_token_ids)
            if o.finished:
                reasons[o.request_id] = o.finish_reason
        step += 1
        for i, at in (abort_at or {}).items():
            if at == step and engine.abort(ids[i]):
                reasons[ids[i]] = "abort"
    assert engine.num_pages_in_use == 0  # nothing leaks, launched-ahead rows included
    return [out[i] for i in ids], [reasons[i] for i in ids]


def _greedy(max_new: list[int], stop: list[list[int]] | None = None) -> list[SamplingParams]:
    stop = stop or [[] for _ in max_new]
    return [
        SamplingParams(max_new_tokens=n, ignore_eos=True, stop_token_ids=s)
        for n, s in zip(max_new, stop, strict=True)
    ]


def test_stop_tokens_and_length_limits(v2_greedy_ckpt: HFCheckpoint) -> None:
    base, _ = _run(_engine(v2_greedy_ckpt, False), _greedy([12, 12, 12, 12]))
    # Request 1 stops at its 4th token, request 3 at its 7th: steps launched ahead for them
    # must be dropped. Request 0 ends by length two steps before the others.
    stop = [[], [base[1][3]], [], [base[3][6]]]
    params = _greedy([10, 12, 12, 12], stop)
    want, want_reasons = _run(_engine(v2_greedy_ckpt, False), params)
    engine = _engine(v2_greedy_ckpt, True)
    got, reasons = _run(engine, params)
    assert got == want and reasons == want_reasons
    assert reasons[1] == "stop" and reasons[0] == "length"
    assert len(got[1]) <= 4 and len(got[0]) == 10
    assert engine.num_launched_ahead > 5


def test_abort_while_a_step_is_launched_ahead(v2_greedy_ckpt: HFCheckpoint) -> None:
    params = _greedy([9, 9, 9, 9])
    want = _run(_engine(v2_greedy_ckpt, False), params, abort_at={2: 4})
    engine = _engine(v2_greedy_ckpt, True)
    got = _run(engine, params, abort_at={2: 4})
    assert got == want
    assert got[1][2] == "abort" and len(got[0][2]) < 9
    assert engine.num_launched_ahead > 3


def test_a_short_pool_retracts_between_launches(v2_greedy_ckpt: HFCheckpoint) -> None:
    """With pages on demand a step launched ahead takes its next page from the free pages
    only; when none is free the scheduler retracts instead. Tokens do not move."""
    params = _greedy([30, 30, 30, 30])  # up to 60 tokens each, 179 in all, in a 64-token pool
    want = _run(_engine(v2_greedy_ckpt, False), params)
    engine = _engine(v2_greedy_ckpt, True, max_total_tokens=64)
    assert _run(engine, params) == want
    assert engine.stats.num_retractions > 0 and engine.num_launched_ahead > 5


def test_a_sampled_row_turns_overlap_off_for_its_batch(v2_greedy_ckpt: HFCheckpoint) -> None:
    """Launching ahead needs the next inputs to be argmaxes; a batch with a sampled row runs
    step by step, with the same tokens as without overlap."""
    params = _greedy([6, 6, 6, 6])
    params[2] = SamplingParams(max_new_tokens=6, temperature=0.8, seed=5, ignore_eos=True)
    want = _run(_engine(v2_greedy_ckpt, False), params)
    engine = _engine(v2_greedy_ckpt, True)
    assert _run(engine, params) == want
    assert engine.num_launched_ahead == 0


@pytest.mark.parametrize(
    "row",
    [
        SamplingParams(max_new_tokens=6, ignore_eos=True, logprobs=2),
        SamplingParams(max_new_tokens=6, ignore_eos=True, frequency_penalty=1.0),
        SamplingParams(max_new_tokens=6, ignore_eos=True, logit_bias=((7, 5.0),)),
    ],
)
def test_greedy_rows_with_logit_adjustments_or_logprobs_run_step_by_step(
    v2_greedy_ckpt: HFCheckpoint, row: SamplingParams
) -> None:
    """Greedy, but not a plain argmax of the logits: no launch ahead, the same tokens."""
    params = _greedy([6, 6, 6, 6])
    params[1] = row
    want = _run(_engine(v2_greedy_ckpt, False), params)
    engine = _engine(v2_greedy_ckpt, True)
    assert _run(engine, params) == want
    assert engine.num_launched_ahead == 0


@pytest.mark.parametrize(("argv", "want"), [([], True), (["--no-overlap-decode"], False)])
def test_cli_switch(argv: list[str], want: bool) -> None:
    import argparse

    from dsmesh.cli.common import add_engine_args, engine_config_from

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config_from(parser.parse_args(argv)).overlap_decode is want


def test_reserve_while_a_step_is_launched_ahead(v2_greedy_ckpt: HFCheckpoint) -> None:
    """A decode instance reserves pages for an arriving request between steps; with a step
    launched ahead the engine first lets it finish (its KV writes are on the stream, the
    transfer's are not). The running requests' tokens do not move, nothing leaks."""
    params = _greedy([8, 8, 8, 8])
    want = _run(_engine(v2_greedy_ckpt, False), params)
    engine = _engine(v2_greedy_ckpt, True)
    prompts = random_prompts(LENGTHS, engine.model_config.vocab_size, seed=3)
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    out: dict[str, list[int]] = {i: [] for i in ids}
    reserved = False
    while engine.has_unfinished():
        for o in engine.step():
            if o.request_id in out:
                out[o.request_id].extend(o.new_token_ids)
        if not reserved and engine.launch_ahead.inflight is not None:
            engine.reserve(prompts[0], SamplingParams(max_new_tokens=2), "arriving")
            reserved = True
    assert reserved
    engine.release("arriving")  # its KV never came
    assert [out[i] for i in ids] == want[0]
    assert engine.num_pages_in_use == 0


def _trace(engine: LLMEngine, params: list[SamplingParams], late: int = 0, late_at: int = 0):
    """The first ``len(params) - late`` requests at once, the others after ``late_at``
    steps. Returns the tokens of each request and the step whose output carried its first
    token."""
    prompts = random_prompts(LENGTHS, engine.model_config.vocab_size, seed=3)
    now = len(prompts) - late
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts[:now], params[:now], strict=True)]
    out: dict[str, list[int]] = {}
    first: dict[str, int] = {}
    step = 0
    while engine.has_unfinished() or len(ids) < len(prompts):
        step += 1
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
            first.setdefault(o.request_id, step)
        if step == late_at:
            later = zip(prompts[now:], params[now:], strict=True)
            ids += [engine.add_request(p, sp) for p, sp in later]
    assert engine.num_pages_in_use == 0
    return [out[i] for i in ids], [first[i] for i in ids]


def test_a_full_batch_launches_ahead_while_requests_wait(v2_greedy_ckpt: HFCheckpoint) -> None:
    """Two running slots, four requests: while two wait for a slot the running pair's steps
    are certain, and a row that ends by length leaves the step launched ahead of it; the
    waiting pair joins at the same step as without overlap."""
    params = _greedy([6, 10, 8, 12])

    def engine(overlap: bool) -> LLMEngine:
        e = _engine(v2_greedy_ckpt, overlap)
        e.scheduler.config = dataclasses.replace(e.scheduler.config, max_running_requests=2)
        return e

    want = _trace(engine(False), params)
    on = engine(True)
    assert _trace(on, params) == want
    # 9 when any waiting request stopped launching ahead, and any row at its length limit
    assert on.num_launched_ahead >= 14


@pytest.mark.parametrize("interval", [1, 4])
def test_launching_ahead_keeps_the_admission_interval(
    v2_greedy_ckpt: HFCheckpoint, interval: int
) -> None:
    """Two requests arrive a step after the first two joined. With ``admit_interval`` 4 the
    steps they wait through launch ahead and count toward the interval, so they join at the
    step they would without overlap; with 1 they join at once, or a step later when a step
    was already launched as they arrived."""
    params = _greedy([14, 14, 14, 14])

    def engine(overlap: bool) -> LLMEngine:
        e = _engine(v2_greedy_ckpt, overlap)
        e.scheduler.config = dataclasses.replace(e.scheduler.config, admit_interval=interval)
        return e

    want, want_first = _trace(engine(False), params, late=2, late_at=2)
    on = engine(True)
    got, got_first = _trace(on, params, late=2, late_at=2)
    assert got == want
    if interval > 1:
        assert got_first == want_first
    else:
        assert got_first[:2] == want_first[:2]
        assert all(w <= g <= w + 1 for w, g in zip(want_first[2:], got_first[2:], strict=True))
    # 12 either way when a waiting request or a row at its length limit stopped launching
    # ahead (and the pair joined a step late with interval 4)
    assert on.num_launched_ahead >= {1: 13, 4: 14}[interval]
