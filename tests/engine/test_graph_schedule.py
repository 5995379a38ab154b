"""Decode graphs captured before and after ready (dsmesh/engine/runner/graph_schedule.py): the
pure policy on CPU; on a GPU, an engine whose larger batch buckets are captured after ready
produces the tokens of one that captured everything before."""

from __future__ import annotations

import pytest
import torch

from dsmesh.engine.llm_engine import EngineConfig, LLMEngine
from dsmesh.engine.runner.graph_schedule import (
    CAPTURE_AFTER_STEPS,
    DeferredCaptures,
    capture_plan,
)
from dsmesh.engine.sampling.params import SamplingParams
from tests.engine.hf_checkpoints import HFCheckpoint, random_prompts

BATCHES = [1, 2, 4, 8, 16, 32, 64]
PAGES = [64, 128, 256]


def test_plan_captures_the_smallest_batches_before_ready() -> None:
    before, after = capture_plan(BATCHES, PAGES, ready_batches=4)
    assert before == [(b, p) for p in PAGES for b in (1, 2, 4, 8)]
    # after ready: smallest batch first, each at every page bucket
    assert after == [(b, p) for b in (16, 32, 64) for p in PAGES]
    assert set(before) | set(after) == {(b, p) for b in BATCHES for p in PAGES}
    assert not set(before) & set(after)


def test_plan_zero_or_more_than_the_buckets_captures_all_before_ready() -> None:
    everything = {(b, p) for b in BATCHES for p in PAGES}
    for ready in (0, len(BATCHES), 100):
        before, after = capture_plan(BATCHES, PAGES, ready)
        assert set(before) == everything and after == []
    with pytest.raises(ValueError, match="ready_batches must be >= 0"):
        capture_plan(BATCHES, PAGES, -1)


def test_queued_buckets_run_uncaptured_until_captured() -> None:
    deferred = DeferredCaptures(capture_plan(BATCHES, PAGES, 4)[1])
    assert len(deferred) == 9
    assert not deferred.runs_uncaptured((8, 64))  # captured before ready: replays
    assert not deferred.runs_uncaptured((64, 512))  # beyond the plan: captured on first use
    assert deferred.runs_uncaptured((32, 128))  # queued: the same forward, uncaptured
    deferred.captured((32, 128))
    assert not deferred.runs_uncaptured((32, 128))
    assert len(deferred) == 8


def test_idle_gaps_capture_the_wanted_graph_first_then_in_order() -> None:
    deferred = DeferredCaptures(capture_plan(BATCHES, PAGES, 4)[1])
    assert deferred.next(idle=True) == (16, 64)  # nothing wanted yet: smallest first
    for _ in range(3):
        deferred.runs_uncaptured((64, 128))
    deferred.runs_uncaptured((32, 64))
    assert deferred.next(idle=True) == (64, 128)  # the one steps wanted most
    captured = []
    while (key := deferred.next(idle=True)) is not None:
        deferred.captured(key)
        captured.append(key)
    assert captured[:2] == [(64, 128), (32, 64)]
    assert sorted(captured[2:]) == captured[2:]  # then the plan's order
    assert len(captured) == 9 and len(deferred) == 0


def test_a_busy_engine_captures_only_a_graph_its_steps_keep_needing() -> None:
    deferred = DeferredCaptures(capture_plan(BATCHES, PAGES, 4)[1])
    assert deferred.next(idle=False) is None  # nothing wanted: no stall of the batch
    for _ in range(CAPTURE_AFTER_STEPS - 1):
        deferred.runs_uncaptured((16, 64))
    assert deferred.next(idle=False) is None
    deferred.runs_uncaptured((16, 64))
    assert deferred.next(idle=False) == (16, 64)


def test_engine_option_defaults_to_four_and_refuses_negative() -> None:
    from dsmesh.cli.common import engine_config_of_flags

    assert EngineConfig().cuda_graph_ready_batches == 4
    assert engine_config_of_flags(["--cuda-graph-ready-batches", "0"]).cuda_graph_ready_batches == 0
    with pytest.raises(Exception, match="cuda-graph-ready-batches"):
        engine_config_of_flags(["--cuda-graph-ready-batches", "-1"])


# ---- GPU: real graphs ------------------------------------------------------------------------

LENGTHS = [3, 9, 17, 30, 40, 5, 12, 21, 26, 7, 33, 2]


def _engine(ckpt: HFCheckpoint, ready_batches: int) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=str(ckpt.path),
            device="cuda",
            dtype="float32",
            page_size=8,
            max_total_tokens=4096,
            max_running_requests=16,
            cuda_graph_min_tokens=64,  # page buckets 8, 16, 32 up to 256 tokens
            cuda_graph_warmup_tokens=256,
            cuda_graph_ready_batches=ready_batches,
        )
    )


def _generate(engine: LLMEngine, vocab: int, capture_between_steps: bool) -> list[list[int]]:
    """Twelve greedy requests at once (batch bucket 16), then the same again; with
    ``capture_between_steps`` the engine captures what is due between steps, as the
    instance's engine thread does."""
    outs: list[list[int]] = []
    for round_ in range(2):
        prompts = random_prompts(LENGTHS, vocab, seed=11 + round_)
        order = [
            engine.add_request(p, SamplingParams(max_new_tokens=12, ignore_eos=True))
            for p in prompts
        ]
        tokens: dict[str, list[int]] = {rid: [] for rid in order}
        while engine.has_unfinished():
            for o in engine.step():
                tokens[o.request_id].extend(o.new_token_ids)
            if capture_between_steps:
                engine.capture_deferred_graph()
        outs += [tokens[rid] for rid in order]
        if capture_between_steps:  # an idle gap: every queued graph, one per call
            while engine.capture_deferred_graph():
                pass
    return outs


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.gpu
def test_deferred_capture_keeps_the_tokens(v2_greedy_ckpt: HFCheckpoint) -> None:
    vocab = v2_greedy_ckpt.hf_model.config.vocab_size
    upfront = _engine(v2_greedy_ckpt, ready_batches=0)
    assert upfront.graph_runner is not None and not upfront.graph_runner.deferred
    expected = _generate(upfront, vocab, capture_between_steps=False)

    engine = _engine(v2_greedy_ckpt, ready_batches=1)
    runner = engine.graph_runner
    assert runner is not None and runner.buckets == [1, 2, 4, 8, 16]
    assert {b for b, _ in runner.graphs} == {1}  # before ready: batch bucket 1 only
    assert len(runner.deferred) == 4 * 3  # buckets 2..16 at page buckets 8, 16, 32
    assert _generate(engine, vocab, capture_between_steps=True) == expected
    assert runner.num_eager > 0  # batch 16 ran uncaptured before its graph existed
    assert not runner.deferred  # all captured in idle gaps or after enough steps
    assert set(runner.graphs) >= set(upfront.graph_runner.graphs)
    assert engine.num_pages_in_use == 0  # the capture's scratch page went back
