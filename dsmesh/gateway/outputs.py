"""A request's output side in the gateway: each message of the instance that streams it
becomes the :class:`Delta` the client gets (tokens, text detokenised incrementally with stop
strings applied, logprobs, prompt logprobs, cached prompt tokens, speculation counts), and the
gateway's latency and token metrics are kept on the way.
"""

from __future__ import annotations

import time

import grpc

from dsmesh.engine.sampling.params import SamplingParams
from dsmesh.engine.sampling.token_logprobs import TokenLogprobs
from dsmesh.engine.tokenizer import Tokenizer
from dsmesh.gateway.metrics import GatewayMetrics
from dsmesh.gateway.request import Delta, GatewayError, GenerationInput
from dsmesh.gateway.stop_strings import OutputText
from dsmesh.runtime.convert import logprobs_from_proto
from dsmesh.v1 import decode_pb2, prefill_pb2


class RequestOutput:
    """One request's deltas, one per message (:meth:`delta`); the one with a finish_reason is
    its last. ``state`` is the request's record in GenerationCore.generate: "waiting" and
    "running" turn when its first token arrives, "outcome" is set when it finishes.
    ``start``: monotonic time the request arrived (TTFT and E2E count from it)."""

    def __init__(
        self,
        inp: GenerationInput,
        tokenizer: Tokenizer,
        metrics: GatewayMetrics,
        start: float,
        state: dict,
    ) -> None:
        self.inp = inp
        self.metrics = metrics
        self.start = start
        self.state = state
        self.output = OutputText(tokenizer, inp.params.stop, inp.params.min_tokens)
        self.completion = 0
        self.cached = 0  # prompt tokens the instance that prefilled it found in its prefix cache
        self.spec: tuple[int, int, int] | None = None  # the decoding instance's speculation counts
        self.wants_prompt = inp.params.prompt_logprobs is not None
        self.scored: list[TokenLogprobs] | None = None  # prompt logprobs, not handed over yet
        self.last = start
        self.first = True
        self.moves = 0  # times the request moved to another instance (migration.py)

    def prefilled(self, answer: prefill_pb2.PrefillResponse) -> None:
        """Prefill's answer (a pair): its cached prompt tokens, and the prompt logprobs it
        computed when the request asks for them."""
        self.cached = answer.cached_tokens
        if self.wants_prompt:  # prefill computed them: they come with its answer
            self.scored = [logprobs_from_proto(lp) for lp in answer.prompt_logprobs]

    def delta(self, msg: decode_pb2.DecodeResponse, unified: bool, moves: int = 0) -> Delta:
        """The delta for the instance's next message (``unified``: from a unified instance,
        which reports the cached tokens and the prompt logprobs in its stream). ``moves``:
        the request moved that many times; after a move the stream goes on where it was
        (its cached tokens stay those of the first instance: the resumed prompt is not the
        client's)."""
        inp, m, state = self.inp, self.metrics, self.state
        self.moves = moves
        now = time.monotonic()
        tokens = list(msg.token_ids)
        logprobs = _logprobs(msg, inp.params)
        prompt_lps = None
        if self.first and self.wants_prompt:
            if unified:  # a unified instance sends them in its stream
                self.scored = [logprobs_from_proto(lp) for lp in msg.prompt_logprobs]
            prompt_lps = _prompt_logprobs(self.scored, inp, msg.finish_reason)
        self.first = False
        if inp.prompt_only:  # the token the instance had to sample is not the client's
            tokens = []
            logprobs = None if logprobs is None else []
        if tokens:
            if state["waiting"]:
                state["waiting"] = False
                state["running"] = True
                m.waiting.dec()
                m.running.inc()
                m.ttft.observe(now - self.start)
            else:
                for _ in tokens:
                    m.itl.observe((now - self.last) / len(tokens))
            self.last = now
            self.completion += len(tokens)
            m.generated_tokens.inc(len(tokens))
        if unified and not moves:
            self.cached = msg.cached_tokens  # a unified instance reports it in its stream
        if msg.HasField("spec"):
            self.spec = (msg.spec.draft_tokens, msg.spec.accepted_tokens, msg.spec.verifications)
        # a stop token id ends the output but, as in vLLM, its text is not shown
        shown = tokens
        stop_id = msg.finish_reason == "stop" and bool(tokens)
        if stop_id and tokens[-1] in inp.params.stop_token_ids:
            shown = tokens[:-1]
        text = self.output.push(shown)
        if self.output.stopped:
            return self._last(tokens, text, "stop", logprobs, prompt_lps)
        reason = msg.finish_reason or None
        if inp.prompt_only and reason == "stop":
            reason = "length"  # it asked for no token, and got none
        if reason is not None:
            text += self.output.finish()
            if self.output.stopped:
                reason = "stop"
            return self._last(tokens, text, reason, logprobs, prompt_lps)
        return self._delta(tokens, text, None, logprobs, prompt_lps)

    def aborted(self) -> Delta:
        """The last delta of a request aborted while it waited for an instance."""
        return self._delta([], "", "abort", None, None)

    def _last(
        self,
        tokens: list[int],
        text: str,
        reason: str,
        logprobs: list[TokenLogprobs] | None,
        prompt_lps: list[TokenLogprobs] | None,
    ) -> Delta:
        self.state["outcome"] = reason
        self.metrics.e2e.observe(time.monotonic() - self.start)
        self.metrics.cached_tokens.inc(self.cached)
        return self._delta(tokens, text, reason, logprobs, prompt_lps)

    def _delta(
        self,
        tokens: list[int],
        text: str,
        reason: str | None,
        logprobs: list[TokenLogprobs] | None,
        prompt_lps: list[TokenLogprobs] | None,
    ) -> Delta:
        return Delta(
            tokens,
            text,
            reason,
            len(self.inp.prompt_ids),
            self.completion,
            self.cached,
            logprobs,
            prompt_logprobs=prompt_lps,
            spec=self.spec,
            migrations=self.moves,
        )


def _logprobs(msg: decode_pb2.DecodeResponse, params: SamplingParams) -> list[TokenLogprobs] | None:
    """The message's logprobs, one per token, when the request asks for them."""
    if params.logprobs is None:
        return None
    if len(msg.logprobs) != len(msg.token_ids):
        raise GatewayError(
            grpc.StatusCode.INTERNAL,
            f"the instance sent {len(msg.logprobs)} logprobs for {len(msg.token_ids)} tokens",
        )
    return [logprobs_from_proto(lp) for lp in msg.logprobs]


def _prompt_logprobs(
    scored: list[TokenLogprobs] | None, inp: GenerationInput, finish_reason: str
) -> list[TokenLogprobs]:
    """The prompt logprobs the request's first delta carries: one per prompt token after the
    first (none when it was aborted before its prompt ran)."""
    expected = len(inp.prompt_ids) - 1
    if finish_reason == "abort" and not scored:
        return []
    if scored is None or len(scored) != expected:
        got = "none" if scored is None else len(scored)
        raise GatewayError(
            grpc.StatusCode.INTERNAL,
            f"the instance sent {got} prompt logprobs for {expected} prompt tokens",
        )
    return scored
