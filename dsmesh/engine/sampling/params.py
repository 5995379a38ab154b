"""Per-request sampling parameters, shared by the engine, the services and the CLI."""

from __future__ import annotations

import math
from dataclasses import dataclass

from dsmesh.engine.errors import InvalidRequestError
from dsmesh.engine.sampling.grammar import GrammarSpec

INT32_MAX = 2**31 - 1  # the wire format's int32 fields
MAX_LOGPROBS = 20  # top alternatives a request may ask for per token (OpenAI's top_logprobs)
MAX_PENALTY = 2.0  # presence and frequency penalties lie in [-2, 2], as OpenAI's
MAX_LOGIT_BIAS = 100.0  # a logit bias lies in [-100, 100], as OpenAI's


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its next tokens, what it reports about them, and when it stops.

    ``temperature == 0`` means greedy. ``top_k == 0`` disables top-k. ``seed`` makes a sampled
    request reproducible whatever else shares its batch.

    Before sampling (greedy included), the logits are adjusted as vLLM does: ``logit_bias``
    (pairs of token id and bias, ids ascending) is added, then ``repetition_penalty`` divides
    the positive logits and multiplies the negative ones of every token in the prompt or the
    output (1 = off), then ``frequency_penalty`` times a token's count in the output and
    ``presence_penalty`` once per token present in the output are subtracted (0 = off).

    ``logprobs`` set to k reports, for every generated token, its log-probability and the k
    most likely tokens' (0 = only its own; None = nothing), under the model's raw distribution:
    ``log_softmax`` of the logits, before any of the adjustments above or temperature.
    ``prompt_logprobs`` set to k reports the same for every prompt token after the first,
    computed during prefill (dsmesh/engine/sampling/prompt_logprobs.py).

    ``min_tokens``: until that many tokens are generated, EOS (unless ``ignore_eos``) and
    ``stop_token_ids`` are masked out of the sampled distribution (as vLLM does; logprobs still
    show the raw distribution), and stop strings do not match (the gateway's concern).

    ``resumed_tokens``: the prompt's last this many tokens are the request's own output from
    an instance it left (a migrated request, docs/RELIABILITY.md). They count as output for
    the seed's generator (one draw per sampled token, so a seeded request resumes at the same
    position), the grammar (replayed through its matcher) and the presence and frequency
    penalties. The budgets (``max_new_tokens``, ``min_tokens``) are what is left of them:
    the gateway subtracts the tokens already generated. Set by the instances from their
    request message, never by a client.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    max_new_tokens: int = 16
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None
    min_tokens: int = 0
    prompt_logprobs: int | None = None
    # structured outputs: every token must follow this grammar (dsmesh/engine/sampling/grammar.py)
    grammar: GrammarSpec | None = None
    resumed_tokens: int = 0

    @property
    def has_penalties(self) -> bool:
        """Whether a penalty reads the request's tokens (prompt and output)."""
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )

    @property
    def adjusts_logits(self) -> bool:
        """Whether the logits change before sampling (a penalty, a logit bias, or stop tokens
        masked until ``min_tokens``)."""
        return self.has_penalties or bool(self.logit_bias) or self.min_tokens > 0

    def validate(self) -> None:
        """Raise :class:`InvalidRequestError` naming the first invalid field."""
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidRequestError(
                "temperature", f"must be a finite number >= 0, got {self.temperature}"
            )
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidRequestError("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidRequestError("top_k", f"must be >= 0 (0 disables it), got {self.top_k}")
        if not (0.0 <= self.min_p < 1.0):
            raise InvalidRequestError("min_p", f"must be in [0, 1), got {self.min_p}")
        if not 1 <= self.max_new_tokens <= INT32_MAX:
            raise InvalidRequestError(
                "max_new_tokens", f"must be in [1, 2**31 - 1], got {self.max_new_tokens}"
            )
        if self.top_k > INT32_MAX:
            raise InvalidRequestError("top_k", f"must be at most 2**31 - 1, got {self.top_k}")
        if self.seed is not None and not (0 <= self.seed < 2**63):
            raise InvalidRequestError("seed", f"must be in [0, 2**63), got {self.seed}")
        if any(not 0 <= t <= INT32_MAX for t in self.stop_token_ids):
            raise InvalidRequestError(
                "stop_token_ids", f"must be in [0, 2**31 - 1], got {list(self.stop_token_ids)}"
            )
        if any(not s for s in self.stop):
            raise InvalidRequestError("stop", "stop strings must not be empty")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -MAX_PENALTY <= value <= MAX_PENALTY:  # False for NaN too
                raise InvalidRequestError(name, f"must be in [-2, 2], got {value}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise InvalidRequestError(
                "repetition_penalty",
                f"must be a finite number > 0 (1 = off), got {self.repetition_penalty}",
            )
        self._validate_logit_bias()
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise InvalidRequestError(
                "logprobs", f"must be in [0, {MAX_LOGPROBS}], got {self.logprobs}"
            )
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise InvalidRequestError(
                "prompt_logprobs", f"must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}"
            )
        if not 0 <= self.min_tokens <= self.max_new_tokens:
            raise InvalidRequestError(
                "min_tokens",
                f"must be in [0, max_new_tokens ({self.max_new_tokens})], got {self.min_tokens}",
            )
        if self.grammar is not None:
            self.grammar.validate()
        if not 0 <= self.resumed_tokens <= INT32_MAX:
            raise InvalidRequestError(
                "resumed_tokens", f"must be in [0, 2**31 - 1], got {self.resumed_tokens}"
            )

    def _validate_logit_bias(self) -> None:
        seen: set[int] = set()
        for token_id, bias in self.logit_bias:
            if not 0 <= token_id <= INT32_MAX:
                raise InvalidRequestError(
                    "logit_bias", f"token id {token_id} must be in [0, 2**31 - 1]"
                )
            if token_id in seen:
                raise InvalidRequestError("logit_bias", f"token id {token_id} appears twice")
            seen.add(token_id)
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise InvalidRequestError(
                    "logit_bias", f"the bias of token {token_id} must be in [-100, 100], got {bias}"
                )

    def check_vocab(self, vocab_size: int) -> None:
        """Raise :class:`InvalidRequestError` when ``logit_bias`` names a token outside the
        model's vocabulary (the other fields do not depend on the model)."""
        for token_id, _ in self.logit_bias:
            if token_id >= vocab_size:
                raise InvalidRequestError(
                    "logit_bias",
                    f"token id {token_id} is outside the vocabulary [0, {vocab_size})",
                )
