"""dsmesh.v1.Generation in domain terms: the handlers the gRPC servicer and REST share.

``n`` > 1 runs the prompt's choices as dsmesh/gateway/choices.py does for the OpenAI routes, their
messages interleaved, each with its ``index``. ``max_new_tokens: 0`` asks for the prompt only
(with ``prompt_logprobs``: prompt scoring); see GenerationInput.prompt_only.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from dsmesh.engine.errors import InvalidRequestError
from dsmesh.gateway.choices import MAX_CHOICES, choice_inputs, generate_choices
from dsmesh.gateway.core import GatewayError, GenerationCore, GenerationInput, invalid
from dsmesh.gateway.request import ChoiceGroup
from dsmesh.runtime.convert import logprobs_to_proto, sampling_from_proto
from dsmesh.v1 import generation_pb2 as pb


def prepare(core: GenerationCore, request: pb.GenerateRequest) -> GenerationInput:
    sampling = request.sampling
    prompt_only = sampling.HasField("max_new_tokens") and sampling.max_new_tokens == 0
    if prompt_only:
        if sampling.min_tokens:
            raise invalid(
                "sampling.min_tokens", "must be 0 with max_new_tokens 0 (the prompt only)"
            )
        sampling = pb.SamplingParams()
        sampling.CopyFrom(request.sampling)
        sampling.max_new_tokens = 1  # sampled by the instance, dropped by the gateway
    try:
        params = sampling_from_proto(sampling)
    except InvalidRequestError as exc:
        raise invalid(exc.field, exc.reason) from exc
    ids = list(request.input_ids)
    return core.prepare(request.request_id, request.text, ids, params, prompt_only=prompt_only)


def num_choices(request: pb.GenerateRequest) -> int:
    """``n``: 0 (unset) means 1."""
    n = request.n or 1
    if not 1 <= n <= MAX_CHOICES:
        raise invalid("n", f"must be in [1, {MAX_CHOICES}], got {request.n}")
    return n


async def generate(
    core: GenerationCore, request: pb.GenerateRequest, trace_parent=None
) -> AsyncIterator[pb.GenerateResponse]:
    """GenerateResponse messages, every choice's; raises GatewayError."""
    n = num_choices(request)
    inp = prepare(core, request)
    group = None
    # a request id names one request, of one choice or of several
    if inp.request_id in core.choice_groups or (n > 1 and inp.request_id in core.active):
        raise GatewayError(
            grpc.StatusCode.ALREADY_EXISTS,
            f"request_id {inp.request_id!r} is already in flight; a request id is used once",
        )
    inputs = choice_inputs(inp, n)
    if n > 1:
        group = ChoiceGroup(tuple(i.request_id for i in inputs))
        core.choice_groups[inp.request_id] = group
    try:
        async for delta in generate_choices(core, inputs, trace_parent, group):
            msg = pb.GenerateResponse(
                request_id=inp.request_id,
                token_ids=delta.token_ids,
                text=delta.text,
                finish_reason=delta.finish_reason or "",
                logprobs=[logprobs_to_proto(lp) for lp in delta.logprobs or ()],
                index=delta.index,
                prompt_logprobs=[logprobs_to_proto(lp) for lp in delta.prompt_logprobs or ()],
            )
            msg.usage.prompt_tokens = delta.prompt_tokens
            msg.usage.completion_tokens = delta.completion_tokens
            msg.usage.cached_tokens = delta.cached_tokens
            if delta.migrations:
                msg.usage.migrations = delta.migrations
            if delta.spec is not None:
                drafted, accepted, verifications = delta.spec
                msg.usage.spec.draft_tokens = drafted
                msg.usage.spec.accepted_tokens = accepted
                msg.usage.spec.verifications = verifications
            yield msg
    finally:
        if group is not None:
            core.choice_groups.pop(inp.request_id, None)


async def abort(core: GenerationCore, request: pb.AbortRequest) -> pb.AbortResponse:
    """Abort a request; one of n > 1 choices has every choice aborted."""
    if not request.request_id:
        raise invalid("request_id", "must be a non-empty string")
    group = core.choice_groups.get(request.request_id)
    if group is None:
        return pb.AbortResponse(aborted=await core.abort(request.request_id))
    group.aborted = True  # choices not started yet end at once
    for rid in group.request_ids:
        await core.abort(rid)
    return pb.AbortResponse(aborted=True)


def aggregate(messages: list[pb.GenerateResponse]) -> pb.GenerateResponse | pb.GenerateChoices:
    """One response holding every new token and all the text (REST, stream=false); with
    several choices, a GenerateChoices of one such response per choice."""
    if not messages:
        # pragma: no cover - generate always yields
        raise GatewayError(grpc.StatusCode.INTERNAL, "no response")
    num = max(m.index for m in messages) + 1
    if num == 1:
        return _aggregate_choice(messages)
    choices = [_aggregate_choice([m for m in messages if m.index == i]) for i in range(num)]
    out = pb.GenerateChoices(request_id=messages[-1].request_id, choices=choices)
    out.usage.prompt_tokens = choices[0].usage.prompt_tokens
    out.usage.cached_tokens = choices[0].usage.cached_tokens
    out.usage.completion_tokens = sum(c.usage.completion_tokens for c in choices)
    moved = sum(c.usage.migrations for c in choices)
    if moved:
        out.usage.migrations = moved
    return out


def _aggregate_choice(messages: list[pb.GenerateResponse]) -> pb.GenerateResponse:
    out = pb.GenerateResponse(request_id=messages[-1].request_id, index=messages[-1].index)
    for m in messages:
        out.token_ids.extend(m.token_ids)
        out.logprobs.extend(m.logprobs)
        out.prompt_logprobs.extend(m.prompt_logprobs)
    out.text = "".join(m.text for m in messages)
    out.finish_reason = messages[-1].finish_reason
    out.usage.CopyFrom(messages[-1].usage)
    return out
