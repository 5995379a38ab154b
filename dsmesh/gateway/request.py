"""A request's data in the gateway: the validated input (:class:`GenerationInput`), what
streams back to the client (:class:`Delta`), the pipeline's limits (:class:`CoreLimits`),
where an admitted request runs (:class:`Placement`), the choices of a request of ``n > 1``
(:class:`ChoiceGroup`, dsmesh/gateway/choices.py), and :class:`GatewayError`, the status a
failed request ends with (REST maps it to an HTTP status)."""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from dsmesh.engine.sampling.params import SamplingParams
from dsmesh.engine.sampling.token_logprobs import TokenLogprobs
from dsmesh.gateway.registry import Instance


class GatewayError(Exception):
    """A request failed; ``code`` is the gRPC status (REST maps it to an HTTP status).
    ``side``: the role whose call failed ("prefill", "decode", "unified"), when one did."""

    def __init__(self, code: grpc.StatusCode, message: str, side: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.side = side


def invalid(field: str, message: str) -> GatewayError:
    return GatewayError(grpc.StatusCode.INVALID_ARGUMENT, f"{field}: {message}")


@dataclass(frozen=True)
class GenerationInput:
    """A validated request. With ``prompt_only`` (the client asked for 0 new tokens) the
    instance still samples one token (the engine finishes a request on a token, and a PD
    handoff commits one), which the gateway drops: the client gets no token, finish_reason
    "length", and the prompt logprobs if it asked for them."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    prompt_only: bool = False


@dataclass(frozen=True)
class Delta:
    """One message to the client: new tokens, their text, and the end when it comes."""

    token_ids: list[int]
    text: str
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens served from a prefix cache, as the instance reported
    # one per token_ids entry when the request asks for logprobs (sampling.logprobs), else None
    logprobs: list[TokenLogprobs] | None = None
    index: int = 0  # which of the request's choices (n > 1, dsmesh/gateway/choices.py)
    # on the first delta, when the request asks for prompt logprobs: one per prompt token
    # after the first (SamplingParams.prompt_logprobs), else None
    prompt_logprobs: list[TokenLogprobs] | None = None
    # speculative decoding: (drafted, accepted, verifications) of the request so far, as the
    # decoding instance reported them; None when it does not speculate
    spec: tuple[int, int, int] | None = None
    # times the request moved to another instance after the one serving it was lost
    migrations: int = 0


@dataclass(frozen=True)
class CoreLimits:
    request_timeout_s: float = 600.0
    handoff_timeout_s: float = 30.0
    # how long requests wait while no instance can serve at all (e.g. the only decode
    # restarts); None: until the request's own deadline (request_timeout_s)
    route_wait_s: float | None = None
    max_inflight: int = 512  # requests dispatched to instances at most; more wait in the queue
    max_queued: int = 1024  # requests waiting in the queue at most; more get 429
    # times a request may move on after the instance serving it is lost (migration.py)
    migration_limit: int = 3
    # KV-aware routing: what a cached prompt token weighs against a token of load; 0: off
    kv_routing_weight: float = 1.0


@dataclass(frozen=True)
class Placement:
    """Where an admitted request runs: ``prefill`` is None on a unified instance."""

    decode: Instance  # the decode or unified instance: it streams the tokens
    prefill: Instance | None
    # the request's id at the instances when not the client's: a request put back in the
    # queue (GenerationCore._requeues) gets one per attempt, since the refused attempt's id stays
    # taken there (kv_broker's tombstone) after its handoff ended
    call_id: str = ""


@dataclass
class ChoiceGroup:
    """The choices of one request, as an Abort of the client's request id sees them: every
    choice id is aborted, and a choice that has not started yet ends "abort" at once."""

    request_ids: tuple[str, ...]
    aborted: bool = False
