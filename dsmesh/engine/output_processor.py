"""The output processor: a step's logits and sampled tokens into request state and outputs.

After a forward, each chunk's computed tokens are counted (``num_computed``) and its full
prompt pages shared; the rows where a token is due are sampled together; each token is then
booked: appended to the request's output, its grammar advanced, and the request finished at
a stop condition (EOS unless ``ignore_eos``, a stop token id, a completed grammar,
``max_new_tokens`` or the context; a prefill-only request after its first token). What the
step did for each request comes back as one :class:`StepOutput`. Not thread-safe: the engine
thread only.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dsmesh.engine.request import Request
from dsmesh.engine.sampling.grammar import GrammarMasks
from dsmesh.engine.sampling.sampler import Sampler
from dsmesh.engine.sampling.token_logprobs import TokenLogprobs
from dsmesh.engine.sched.scheduler import ScheduledChunk, Scheduler

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepOutput:
    """What one step did for one request.

    ``computed`` is the range of token positions whose KV this step wrote (empty for a
    request that only finished); ``new_token_ids`` is empty for a mid-prompt chunk.
    ``logprobs`` has one entry per new token when the request asks for logprobs, else None.
    ``prompt_logprobs``: when the request asks for them, the prompt tokens this step scored,
    in order, continuing where the previous output left off (the first prompt token has none;
    dsmesh/engine/sampling/prompt_logprobs.py), else None.
    """

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    computed: tuple[int, int] = (0, 0)
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs] | None = None
    # speculative decoding: the request's (drafted, accepted, verifications) so far, on the
    # outputs of a speculative step; None elsewhere
    spec_counts: tuple[int, int, int] | None = None


class OutputProcessor:
    """Books sampled tokens into requests. ``requests`` is the engine's table of requests by
    id: a request that finishes and keeps no pages is dropped from it here."""

    def __init__(
        self,
        scheduler: Scheduler,
        sampler: Sampler,
        grammar: GrammarMasks,
        eos_token_ids: Sequence[int],
        requests: dict[str, Request],
    ) -> None:
        self.scheduler = scheduler
        self.sampler = sampler
        self.grammar = grammar
        self.eos_token_ids = eos_token_ids
        self.requests = requests

    def process(
        self,
        chunks: list[ScheduledChunk],
        logits: torch.Tensor,
        scored: dict[str, list[TokenLogprobs]],
    ) -> list[StepOutput]:
        """A plain step's outputs: ``logits`` [len(chunks), vocab] are each chunk's last
        token's; a token is sampled where the chunk fed every known token of its request.
        ``scored``: the prompt logprobs the step computed, by request id."""
        due_rows: list[int] = []
        due: list[Request] = []
        computed: dict[str, tuple[int, int]] = {}
        outputs: list[StepOutput] = []
        for row, c in enumerate(chunks):
            req = c.request
            start = req.num_computed
            req.num_computed += c.num_tokens
            computed[req.request_id] = (start, req.num_computed)
            if start < len(req.prompt_ids):
                self.scheduler.share_prompt(req)  # e.g. the other choices of an n > 1 request
            if req.num_computed == req.num_tokens:  # all known tokens fed: a new one is due
                due_rows.append(row)
                due.append(req)
            else:
                outputs.append(
                    StepOutput(req.request_id, [], False, None, computed[req.request_id])
                )
        if due:
            if len(due_rows) == logits.shape[0]:  # every row (decode): no gather
                due_logits = logits
            else:
                due_logits = logits.index_select(0, torch.tensor(due_rows, device=logits.device))
            sampled = self.sampler(
                due_logits,
                [r.params for r in due],
                [r.generator for r in due],
                [r.prompt_ids for r in due],
                [r.output_ids for r in due],
                allowed=self.allowed_tokens(due),  # after the forward: overlaps it
            )
            tokens = sampled.token_ids.tolist()
            logprobs = sampled.logprobs or [None] * len(due)
            for req, tok, lp in zip(due, tokens, logprobs, strict=True):
                outputs.append(self.book_token(req, tok, computed[req.request_id], lp))
        if scored:
            outputs = [
                dataclasses.replace(o, prompt_logprobs=scored.get(o.request_id))
                if o.request_id in scored
                else o
                for o in outputs
            ]
        return outputs

    def allowed_tokens(self, reqs: list[Request]) -> torch.Tensor | None:
        """The allowed-token bitmask [len(reqs), ceil(vocab / 32)] int32 (host memory) of a
        step whose rows sample for ``reqs``, or None when none is constrained. Called after
        the forward is launched, so on a GPU the grammar's work overlaps it."""
        return self.grammar.allowed([r.grammar for r in reqs])

    def book_token(
        self,
        req: Request,
        tok: int,
        computed: tuple[int, int],
        logprobs: TokenLogprobs | None = None,
    ) -> StepOutput:
        """Append a sampled token, finish the request if it stops there, report it."""
        req.output_ids.append(tok)
        self.advance_grammar(req, tok)
        reason = "prefilled" if req.prefill_only else self.stop_reason(req, tok)
        if reason is not None:
            self.scheduler.finish(req, reason)
            if not req.keep_pages:
                self.requests.pop(req.request_id, None)
        reported = None if logprobs is None else [logprobs]
        return StepOutput(req.request_id, [tok], reason is not None, reason, computed, reported)

    def book_run(
        self,
        req: Request,
        start: int,
        first_computed: int,
        tokens: list[int],
        logprobs: list[TokenLogprobs] | None,
    ) -> StepOutput:
        """Book the tokens one speculative step emitted for ``req`` in order, stopping at the
        first that ends it (a stop token, max_new_tokens); booking token j leaves
        ``num_computed = first_computed + j``: the KV of the rejected positions is dropped."""
        booked: list[StepOutput] = []
        for j, tok in enumerate(tokens):
            req.num_computed = first_computed + j
            lp = None if logprobs is None else logprobs[j]
            booked.append(self.book_token(req, tok, (start, req.num_computed), lp))
            if booked[-1].finished:
                break
        last = booked[-1]
        reported = None if logprobs is None else [lp for o in booked for lp in o.logprobs or []]
        return dataclasses.replace(
            last, new_token_ids=[t for o in booked for t in o.new_token_ids], logprobs=reported
        )

    def first_token(
        self, req: Request, tok: int, logprobs: TokenLogprobs | None
    ) -> StepOutput:
        """The output of a reserved request's first token, sampled elsewhere and already
        appended (``LLMEngine.activate``): the request finishes here if that token ends it."""
        reason = self.stop_reason(req, tok)
        if reason is not None:
            self.scheduler.finish(req, reason)
            self.requests.pop(req.request_id, None)
        reported = None if logprobs is None else [logprobs]
        return StepOutput(req.request_id, [tok], reason is not None, reason, logprobs=reported)

    def advance_grammar(self, req: Request, tok: int) -> None:
        if req.grammar is not None and not req.grammar.accept(tok):
            log.warning(
                "request %s: token %d breaks its grammar (%s); it stops here",
                req.request_id,
                tok,
                req.grammar.error,
            )

    def stop_reason(self, req: Request, tok: int) -> str | None:
        p = req.params
        if not p.ignore_eos and tok in self.eos_token_ids:
            return "stop"
        if req.grammar is not None and req.grammar.is_terminated:
            return "stop"  # the grammar is complete (only EOS could follow)
        if tok in p.stop_token_ids:
            return "stop"
        if len(req.output_ids) >= p.max_new_tokens or req.num_tokens >= req.max_total_tokens:
            return "length"
        return None
