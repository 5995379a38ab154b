"""Proto <-> engine conversions shared by the servicers."""

from __future__ import annotations

import grpc

from dsmesh.engine.errors import InvalidRequestError
from dsmesh.engine.sampling.grammar import GrammarSpec
from dsmesh.engine.sampling.params import SamplingParams
from dsmesh.engine.sampling.token_logprobs import TokenLogprobs
from dsmesh.v1 import generation_pb2

DEFAULT_MAX_NEW_TOKENS = 16
MAX_STOP_STRINGS = 16


def sampling_from_proto(msg: generation_pb2.SamplingParams) -> SamplingParams:
    """Unset optional fields take the defaults; 0 is a real value (temperature 0 = greedy)."""
    defaults = SamplingParams(max_new_tokens=DEFAULT_MAX_NEW_TOKENS)
    if len(msg.stop) > MAX_STOP_STRINGS:
        raise InvalidRequestError("sampling.stop", f"at most {MAX_STOP_STRINGS} stop strings")
    params = SamplingParams(
        temperature=msg.temperature if msg.HasField("temperature") else defaults.temperature,
        top_p=msg.top_p if msg.HasField("top_p") else defaults.top_p,
        top_k=msg.top_k if msg.HasField("top_k") else defaults.top_k,
        min_p=msg.min_p if msg.HasField("min_p") else defaults.min_p,
        max_new_tokens=(
            msg.max_new_tokens if msg.HasField("max_new_tokens") else defaults.max_new_tokens
        ),
        seed=msg.seed if msg.HasField("seed") else None,
        stop_token_ids=tuple(msg.stop_token_ids),
        stop=tuple(msg.stop),
        ignore_eos=msg.ignore_eos,
        presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty,
        repetition_penalty=(
            msg.repetition_penalty
            if msg.HasField("repetition_penalty")
            else defaults.repetition_penalty
        ),
        logit_bias=tuple(sorted(msg.logit_bias.items())),
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
        min_tokens=msg.min_tokens,
        prompt_logprobs=msg.prompt_logprobs if msg.HasField("prompt_logprobs") else None,
        grammar=grammar_from_proto(msg.grammar) if msg.HasField("grammar") else None,
    )
    try:
        params.validate()
    except InvalidRequestError as exc:
        raise exc.within("sampling") from exc
    return params


def sampling_to_proto(params: SamplingParams) -> generation_pb2.SamplingParams:
    msg = generation_pb2.SamplingParams(
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        min_p=params.min_p,
        max_new_tokens=params.max_new_tokens,
        stop=list(params.stop),
        stop_token_ids=list(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty,
        logit_bias=dict(params.logit_bias),
        min_tokens=params.min_tokens,
    )
    if params.prompt_logprobs is not None:
        msg.prompt_logprobs = params.prompt_logprobs
    if params.seed is not None:
        msg.seed = params.seed
    if params.logprobs is not None:
        msg.logprobs = params.logprobs
    if params.grammar is not None:
        msg.grammar.CopyFrom(grammar_to_proto(params.grammar))
    return msg


def grammar_from_proto(msg: generation_pb2.Grammar) -> GrammarSpec:
    """The spec of a set ``Grammar`` (InvalidRequestError when no kind is set)."""
    kind = msg.WhichOneof("kind")
    if kind is None:
        raise InvalidRequestError("grammar", "set one kind: json_schema, json_object, regex, ...")
    if kind == "json_object":
        if not msg.json_object:
            raise InvalidRequestError("grammar.json_object", "must be true when set")
        return GrammarSpec.json_object()
    return GrammarSpec(kind, getattr(msg, kind))


def grammar_to_proto(spec: GrammarSpec) -> generation_pb2.Grammar:
    if spec.kind == "json_object":
        return generation_pb2.Grammar(json_object=True)
    return generation_pb2.Grammar(**{spec.kind: spec.source})


def logprobs_to_proto(logprobs: TokenLogprobs) -> generation_pb2.TokenLogprobs:
    return generation_pb2.TokenLogprobs(
        token_id=logprobs.token_id,
        logprob=logprobs.logprob,
        top=[generation_pb2.TokenLogprob(token_id=t, logprob=lp) for t, lp in logprobs.top],
    )


def logprobs_from_proto(msg: generation_pb2.TokenLogprobs) -> TokenLogprobs:
    return TokenLogprobs(msg.token_id, msg.logprob, tuple((t.token_id, t.logprob) for t in msg.top))


def require_request_id(request_id: str) -> None:
    if not request_id:
        raise InvalidRequestError("request_id", "must be a non-empty string")
    if len(request_id) > 256:
        raise InvalidRequestError("request_id", "must be at most 256 characters")


async def abort_invalid(context: grpc.aio.ServicerContext, exc: InvalidRequestError) -> None:
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))


def spec_to_proto(counts: tuple[int, int, int] | None) -> generation_pb2.SpecUsage | None:
    """A request's (drafted, accepted, verifications) speculation counts as the proto."""
    if counts is None:
        return None
    drafted, accepted, verifications = counts
    return generation_pb2.SpecUsage(
        draft_tokens=drafted, accepted_tokens=accepted, verifications=verifications
    )
