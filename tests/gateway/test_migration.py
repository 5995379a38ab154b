"""The pure migration state (dsmesh/gateway/migration.py): which failures move a request,
the limit, and the input a moved request resumes with."""

from __future__ import annotations

import grpc
import pytest

from dsmesh.engine.sampling.params import SamplingParams
from dsmesh.gateway.migration import Migration
from dsmesh.gateway.request import GenerationInput


def _inp(**params) -> GenerationInput:
    return GenerationInput("r1", [1, 2, 3], SamplingParams(**params))


def test_resume_sends_prompt_and_output_with_what_is_left_of_the_budgets() -> None:
    inp = _inp(max_new_tokens=10, min_tokens=4, seed=7, temperature=0.8, prompt_logprobs=2)
    mig = Migration(inp, limit=3)
    mig.streamed([9, 8])
    mig.streamed([7])
    nxt = mig.resume()
    assert nxt.request_id == "r1"
    assert nxt.prompt_ids == [1, 2, 3, 9, 8, 7]
    assert nxt.params.max_new_tokens == 7
    assert nxt.params.min_tokens == 1
    assert nxt.params.resumed_tokens == 3
    assert nxt.params.seed == 7 and nxt.params.temperature == 0.8  # the seed is kept
    assert nxt.params.prompt_logprobs is None  # the client has them already
    nxt.params.validate()
    assert inp.prompt_ids == [1, 2, 3]  # the client's input is untouched
    assert mig.moves == 1
    # a second move resumes from everything streamed, across both attempts
    mig.streamed([6])
    again = mig.resume()
    assert again.prompt_ids == [1, 2, 3, 9, 8, 7, 6]
    assert again.params.max_new_tokens == 6 and again.params.min_tokens == 0
    assert again.params.resumed_tokens == 4
    assert mig.moves == 2


def test_a_request_lost_before_its_first_message_is_sent_again_as_it_was() -> None:
    inp = _inp(max_new_tokens=5, prompt_logprobs=1)
    mig = Migration(inp, limit=1)
    assert mig.resume() is inp


def test_only_a_lost_instance_moves_a_request_and_only_up_to_the_limit() -> None:
    mig = Migration(_inp(max_new_tokens=4), limit=2)
    unavailable = grpc.StatusCode.UNAVAILABLE
    for code in (
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.ALREADY_EXISTS,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.INTERNAL,
    ):
        assert not mig.may_move(code, 10.0), code
    assert not mig.may_move(unavailable, 0.0)  # no time left
    assert mig.may_move(unavailable, 10.0)
    mig.resume()
    assert mig.may_move(unavailable, 10.0)
    mig.resume()
    assert not mig.may_move(unavailable, 10.0)  # two moves: the limit


def test_limit_zero_never_moves_and_a_finished_budget_does_not_move() -> None:
    assert not Migration(_inp(), limit=0).may_move(grpc.StatusCode.UNAVAILABLE, 10.0)
    mig = Migration(_inp(max_new_tokens=2), limit=3)
    mig.streamed([5, 6])
    assert not mig.may_move(grpc.StatusCode.UNAVAILABLE, 10.0)
    with pytest.raises(ValueError, match="migration limit"):
        Migration(_inp(), limit=-1)


def test_call_ids_differ_per_attempt() -> None:
    mig = Migration(_inp(), limit=3)
    assert mig.call_id(0) == "r1"
    assert len({mig.call_id(i) for i in range(4)}) == 4
