"""Request migration: when the instance streaming a request dies, the gateway sends the
request again, to a healthy or restarted instance, as its prompt followed by the tokens the
client already has, with what is left of its budgets; the client's stream goes on with no
gap and no repeated token (docs/RELIABILITY.md, "Migration").

Pure state, one :class:`Migration` per request: it records the tokens the request's
instances streamed, says whether a failure is one to move on from, and builds the input of
the next attempt. The gateway core (dsmesh/gateway/core.py) gathers the inputs and applies
the outputs: it re-queues the request, names the new call, counts the move.

What carries over, and why it is exact:

- Greedy output: the resumed prompt is the same token sequence, so the next token is the one
  the undisturbed run computes (as after the engine's own retraction, which recomputes
  output tokens as prompt).
- A seeded sampled request draws one uniform per sampled token from its own generator;
  the instance advances a resumed request's generator by the tokens it did not sample
  (``SamplingParams.resumed_tokens``), so the next draw is the one it would have made.
- Grammar: the instance replays the resumed tokens through a fresh matcher.
- Presence and frequency penalties count the resumed tokens as output (the instance splits
  them off the prompt); the repetition penalty reads prompt and output alike.
- Stop strings and detokenisation live in the gateway, across attempts; logprobs come per
  token; prompt logprobs, once delivered, are not asked for again. Each of ``n`` choices is
  its own request and moves on its own.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import grpc

from dsmesh.gateway.request import GenerationInput

# A status that means the instance (or the connection to it, or kv_broker's record of the
# handoff) is gone, not that the request is wrong: UNAVAILABLE. Everything else (a bad
# argument, a duplicate id, a deadline) would fail the same way again.
MOVABLE_CODES = frozenset({grpc.StatusCode.UNAVAILABLE})


@dataclass
class Migration:
    """One request's progress across instances.

    ``inp``: the request as the client sent it. ``limit``: how many times it may move
    (``--migration-limit``; 0 = never: a lost request fails UNAVAILABLE).
    ``generated``: every token the request's instances streamed so far, in order (the
    client has them all); ``moves``: how many times it moved; ``delivered_first``: the
    first message (which carries the prompt logprobs) reached the client.
    """

    inp: GenerationInput
    limit: int
    generated: list[int] = field(default_factory=list)
    moves: int = 0
    delivered_first: bool = False

    def __post_init__(self) -> None:
        if self.limit < 0:
            raise ValueError(f"migration limit must be >= 0, got {self.limit}")

    def streamed(self, token_ids: list[int]) -> None:
        """An instance streamed these tokens, and they went to the client."""
        self.generated.extend(token_ids)
        self.delivered_first = True

    @property
    def budget_left(self) -> int:
        return self.inp.params.max_new_tokens - len(self.generated)

    def may_move(self, code: grpc.StatusCode, time_left_s: float) -> bool:
        """Whether a request whose attempt failed with ``code`` goes to another instance:
        the status says the instance is lost, the limit allows one more move, the request
        still has time and tokens to generate."""
        return (
            code in MOVABLE_CODES
            and self.moves < self.limit
            and time_left_s > 0
            and self.budget_left > 0
        )

    def resume(self) -> GenerationInput:
        """The next attempt's input (counts the move): the prompt followed by the generated
        tokens, ``max_new_tokens`` and ``min_tokens`` reduced by them, prompt logprobs asked
        for only if the client has not had them yet."""
        self.moves += 1
        params = self.inp.params
        done = len(self.generated)
        if done == 0 and not self.delivered_first:
            return self.inp  # nothing reached the client: the same request again
        params = dataclasses.replace(
            params,
            max_new_tokens=params.max_new_tokens - done,
            min_tokens=max(0, params.min_tokens - done),
            prompt_logprobs=None,
            resumed_tokens=done,
        )
        return dataclasses.replace(
            self.inp, prompt_ids=[*self.inp.prompt_ids, *self.generated], params=params
        )

    def call_id(self, attempt: int) -> str:
        """The request's id at the instances on attempt ``attempt`` (0: the client's). A
        failed attempt's id stays taken there (kv_broker's record), so each gets its own."""
        rid = self.inp.request_id
        return rid if attempt == 0 else f"{rid}~{attempt}"
