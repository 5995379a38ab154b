"""Speculative decoding with the MTP draft (EAGLE-style chain), one engine step at a time.

A step of a speculating engine runs in two halves around the engine's bookkeeping:

1. :meth:`MTPSpeculator.verify` runs the target model once over the scheduled step. A
   decoding request feeds its last token and its ``k`` drafted tokens, each as its own row
   of the batch (a row per position, context growing by one: causal attention over the
   paged cache through the batched decode path, exactly the attention a plain decode step
   computes). Prompt chunks run as usual. The emitted tokens follow
   :mod:`dsmesh.engine.spec.acceptance`; the engine then books them, cutting the run at a stop token
   or ``max_new_tokens``. KV written for rejected positions is simply overwritten later:
   ``num_computed`` is the roll-back (in the target's layers and the draft's alike).
2. :meth:`MTPSpeculator.draft` runs the MTP layer over every position whose target hidden
   state the step produced (pairs ``(h[p], x[p + 1])``, writing the draft's KV there), which
   yields the first draft; ``k - 1`` more single-token MTP steps chain from the draft's own
   hidden state. The drafts wait on the request (:class:`DraftProposal`) for the next step.

Requests whose sampling cannot be verified exactly this way (sampled with penalties, a logit
bias or ``min_tokens``; grammar-constrained) draft nothing and decode one token per step in
the same batch. The draft KV lives in the same pages as the target's, as extra pool layers.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from dsmesh.engine.kv.pool import MLAKVPool, pages_for
from dsmesh.engine.model.deepseek import DeepseekForCausalLM
from dsmesh.engine.model.forward_batch import ForwardBatch, SequenceChunk
from dsmesh.engine.model.mtp import MTPDraft
from dsmesh.engine.request import Request, RequestStatus
from dsmesh.engine.runner.cuda_graph import CudaGraphRunner
from dsmesh.engine.runner.decode_graphs import GraphCaptureError
from dsmesh.engine.sampling.sampler import GREEDY_BELOW, Sampler, token_logprobs
from dsmesh.engine.sampling.token_logprobs import TokenLogprobs
from dsmesh.engine.sched.scheduler import ScheduledChunk, Scheduler
from dsmesh.engine.spec.acceptance import accept_greedy, accept_sampled, draw, sampling_probs
from dsmesh.engine.spec.graphs import GreedyStep, GroupBuckets, SpecGraphs
from dsmesh.engine.spec.mtp_graph import MTPGraphRunner

log = logging.getLogger(__name__)

SPECULATIVE_METHODS = ("mtp",)


@dataclass(frozen=True)
class SpeculativeConfig:
    """How a speculating engine drafts."""

    num_draft_tokens: int = 1  # K: tokens drafted per step, verified in one target forward
    # Decode batches larger than this run without speculation (plain steps, CUDA graphs):
    # verifying K + 1 positions per request stops paying once the batch is compute-bound.
    max_batch: int = 64
    # BENCHMARK ONLY: accept each draft of a greedy request with this probability (the chain
    # stops at the first rejection) whatever the models say, emitting the target's tokens:
    # random weights accept nothing, and this simulates a real MTP's acceptance. Output is
    # not the model's greedy output. None = real verification.
    forced_acceptance: float | None = None
    attention_mode: str = "auto"
    page_size: int = 16
    # the target's forwards as two micro-batches (EngineConfig.tbo); the MTP layer's draft
    # forwards run as one batch
    tbo: bool = False


@dataclass
class DraftProposal:
    """Drafts waiting on a request: valid while the request still has ``num_tokens`` tokens
    (a later step, a retraction's recompute, or a plain step makes them stale)."""

    num_tokens: int
    token_ids: list[int]
    probs: torch.Tensor | None  # [k, vocab] float32, the q each draft was drawn from (sampled)


@dataclass(frozen=True)
class SpecStats:
    """Counters since the engine started."""

    num_verifications: int  # request-steps that verified at least one draft
    num_draft_tokens: int
    num_accepted_tokens: int
    # accepted_histogram[a]: verifications that accepted a drafts (a = 0 .. K)
    accepted_histogram: tuple[int, ...]

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verification: accepted drafts + the target's own token."""
        if not self.num_verifications:
            return 0.0
        return 1.0 + self.num_accepted_tokens / self.num_verifications


@dataclass
class Verified:
    """One scheduled chunk after :meth:`MTPSpeculator.verify`. ``tokens`` are the tokens to
    book (empty mid-prompt); booking token j leaves ``num_computed = first_computed + j``."""

    request: Request
    start: int  # num_computed before the step
    row: int  # the chunk's first row of the step's hidden states
    num_fed: int
    first_computed: int
    tokens: list[int]
    logprobs: list[TokenLogprobs] | None
    decoding: bool  # a decode (verify) row, not a prompt chunk


def _takes_argmax(req: Request) -> bool:
    """The request's token is the argmax of the raw logits and nothing else is reported
    about it: a greedy speculative step can resolve it on the device."""
    p = req.params
    return (
        p.temperature < GREEDY_BELOW
        and not p.adjusts_logits
        and p.logprobs is None
        and getattr(req, "grammar", None) is None
    )


def drafts_allowed(req: Request) -> bool:
    """Whether ``req``'s sampling can be verified against drafts exactly."""
    p = req.params
    if getattr(req, "grammar", None) is not None:
        return False
    return p.temperature < GREEDY_BELOW or not p.adjusts_logits


class MTPSpeculator:
    """Verifies and drafts for an :class:`dsmesh.engine.llm_engine.LLMEngine`; owns no request.
    Not thread-safe: the engine thread only."""

    def __init__(
        self,
        config: SpeculativeConfig,
        model: DeepseekForCausalLM,
        draft: MTPDraft,
        kv_pool: MLAKVPool,
        scheduler: Scheduler,
        sampler: Sampler,
        device: torch.device,
    ) -> None:
        if config.num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens must be >= 1, got {config.num_draft_tokens}")
        self.config = config
        self.model = model
        self.draft_model = draft
        self.kv_pool = kv_pool
        self.scheduler = scheduler
        self.sampler = sampler
        self.device = device
        self._hidden: torch.Tensor | None = None
        self._forced = random.Random(0)
        # CUDA graphs of decode-only steps (attach_graphs); a greedy step's drafts wait in
        # _greedy between verify and draft
        self.graphs: SpecGraphs | None = None
        self._greedy: GreedyStep | None = None
        # expert-parallel groups (join_group): the step's agreed buckets (None: eager), the
        # draft forwards this rank ran in the step, and what its padding forwards feed
        self._in_group = False
        self._group: GroupBuckets | None = None
        self._num_draft_forwards = 0
        self._idle_page: list[int] = []
        self._idle_hidden: torch.Tensor | None = None
        k = config.num_draft_tokens
        self.num_verifications = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_histogram = [0] * (k + 1)

    def stats(self) -> SpecStats:
        return SpecStats(
            self.num_verifications,
            self.num_draft_tokens,
            self.num_accepted_tokens,
            tuple(self.accepted_histogram),
        )

    def attach_graphs(self, target: CudaGraphRunner, warmup_tokens: int = 0) -> None:
        """Run decode-only steps on ``target``'s graphs and the draft's own over the same
        buffers (dsmesh/engine/spec/graphs.py), capturing the draft's buckets for contexts up to
        ``warmup_tokens`` now (before any request exists). A capture failure leaves the
        steps eager. ``target`` must take ``K + 1`` rows per request of a speculative step."""
        try:
            draft = MTPGraphRunner(self.draft_model, target)
            draft.warm_up(warmup_tokens)
        except (GraphCaptureError, ValueError):
            log.exception("CUDA graphs off for speculative steps; they run eagerly")
            return
        self.graphs = SpecGraphs(target, draft, self.config.num_draft_tokens)

    def detach_graphs(self) -> None:
        """Run every step eagerly from now on (A/B runs)."""
        self.graphs = None

    def reset_graphs(self) -> None:
        """After the target's kernels were switched: the draft takes them too, and its
        graphs are recaptured on use (the caller resets the target's runner)."""
        self.draft_model.set_kernels(self.model)
        if self.graphs is not None:
            self.graphs.draft.reset()

    def runs(self, chunks: list[ScheduledChunk]) -> bool:
        """Whether this step speculates: its decode batch is at most ``max_batch``."""
        decoding = sum(1 for c in chunks if not c.request.is_prefilling)
        return decoding <= self.config.max_batch

    # ---- verify ---------------------------------------------------------------------------

    def verify(
        self,
        chunks: list[ScheduledChunk],
        allowed_tokens: Callable[[list[Request]], torch.Tensor | None],
    ) -> list[Verified]:
        """The target forward over ``chunks`` and the tokens each emits (not booked)."""
        seqs: list[SequenceChunk] = []
        plan: list[tuple[Verified, list[int]]] = []
        row = 0  # rows of the hidden states: one per token fed
        for c in chunks:
            req = c.request
            assert req.page_table is not None
            start = req.num_computed
            decoding = not req.is_prefilling
            drafts = self._valid_drafts(req) if decoding else []
            if decoding:
                ids = req.pending_ids(1) + drafts
                seqs += [SequenceChunk([t], start + i, req.page_table) for i, t in enumerate(ids)]
                first_computed = start + 1
            else:
                ids = req.pending_ids(c.num_tokens)
                seqs.append(SequenceChunk(ids, start, req.page_table))
                first_computed = start + len(ids)
            v = Verified(req, start, row, len(ids), first_computed, [], None, decoding)
            plan.append((v, drafts))
            row += len(ids)
        graphs = self._step_graphs(all(v.decoding for v, _ in plan), len(seqs))
        if graphs is not None:
            try:
                if all(_takes_argmax(v.request) for v, _ in plan):
                    self._verify_greedy(graphs, plan)
                else:  # every row's logits, in order: the rows _choose wants
                    logits, self._hidden = graphs.verify(*_rows(seqs), self._group)
                    self._choose(plan, logits, allowed_tokens)
                return [v for v, _ in plan]
            except GraphCaptureError:  # nothing booked yet: the eager forward redoes it
                if self._in_group:  # the other ranks run this step on their graphs
                    raise
                log.exception("CUDA graphs off for speculative steps; they run eagerly")
                self.graphs = None
        batch = self._batch(seqs)
        hidden = self.model.hidden_states(batch, self.kv_pool, self._mode, self.config.tbo)
        self._hidden = hidden

        # Rows whose logits are needed: every verify row, the last row of a finished prompt.
        wanted: list[int] = []
        for v, _ in plan:
            if v.decoding:
                wanted += range(v.row, v.row + v.num_fed)
            elif v.first_computed == v.request.num_tokens:
                wanted.append(v.row + v.num_fed - 1)
        if not wanted:
            return [v for v, _ in plan]
        index = torch.tensor(wanted, dtype=torch.int64, device=hidden.device)
        logits = self.model.compute_logits(hidden.index_select(0, index))
        self._choose(plan, logits, allowed_tokens)
        return [v for v, _ in plan]

    def _verify_greedy(self, graphs: SpecGraphs, plan: list[tuple[Verified, list[int]]]) -> None:
        """A decode-only step whose every request takes the argmax: verified and drafted on
        the graphs with one host sync (:meth:`SpecGraphs.greedy_step`); the drafts wait in
        ``_greedy`` for :meth:`draft`. Chained drafts placed on the device need pages for
        every position they may write, taken now (from free pages only)."""
        k = self.config.num_draft_tokens
        page = self.config.page_size
        on_device = k > 1 and graphs.chain_on_device
        limits = []
        for v, drafts in plan:
            req = v.request
            if on_device:  # the chain writes up to position start + len(drafts) + k - 1
                self.scheduler.try_grow(req, min(v.start + len(drafts) + k, req.max_total_tokens))
            limits.append(len(req.pages) * page - 1)
        # clamped chain positions must stay past every position whose draft KV is kept
        on_device = on_device and all(
            limit > v.start + len(d) for limit, (v, d) in zip(limits, plan, strict=True)
        )
        forced = None
        if self.config.forced_acceptance is not None:
            forced = [self._accepted(drafts, []) for _, drafts in plan]
        step = graphs.greedy_step(
            [v.request.pending_ids(1) + drafts for v, drafts in plan],
            [v.start for v, _ in plan],
            [v.request.pages_array() for v, _ in plan],
            limits,
            forced,
            on_device,
            self._group,
        )
        self._num_draft_forwards += k if on_device else 1  # the first draft, then the chain
        for (v, drafts), tokens, accepted in zip(plan, step.tokens, step.accepted, strict=True):
            v.tokens = tokens
            if drafts:
                self._count(v.request, len(drafts), accepted)
        self._greedy = step

    def _choose(
        self,
        plan: list[tuple[Verified, list[int]]],
        logits: torch.Tensor,
        allowed_tokens: Callable[[list[Request]], torch.Tensor | None],
    ) -> None:
        """Fill each planned chunk's ``tokens`` from ``logits`` [rows wanted, vocab]."""
        # Rows that the sampler decides (greedy verify rows, finished prompts, plain decode
        # rows) go through it together; sampled chains go through rejection sampling.
        sampler_rows: list[int] = []
        row_reqs: list[Request] = []
        row_outputs: list[list[int]] = []
        chains: list[tuple[Verified, list[int], int]] = []
        at = 0
        for v, drafts in plan:
            req = v.request
            n = len(drafts) + 1 if v.decoding else int(v.first_computed == req.num_tokens)
            if n == 0:
                continue
            if drafts and req.params.temperature >= GREEDY_BELOW:
                chains.append((v, drafts, at))
            else:
                for i in range(n):
                    sampler_rows.append(at + i)
                    row_reqs.append(req)
                    row_outputs.append(req.output_ids + drafts[:i])
            at += n
        picked: dict[int, tuple[int, TokenLogprobs | None]] = {}
        if sampler_rows:
            index = torch.tensor(sampler_rows, dtype=torch.int64, device=logits.device)
            out = self.sampler(
                logits.index_select(0, index),
                [r.params for r in row_reqs],
                [r.generator for r in row_reqs],
                [r.prompt_ids for r in row_reqs],
                row_outputs,
                allowed_tokens(row_reqs),
            )
            lps = out.logprobs or [None] * len(sampler_rows)
            for r, tok, lp in zip(sampler_rows, out.token_ids.tolist(), lps, strict=True):
                picked[r] = (tok, lp)
        at = 0
        chain_at = {id(v): (drafts, a) for v, drafts, a in chains}
        for v, drafts in plan:
            req = v.request
            n = len(drafts) + 1 if v.decoding else int(v.first_computed == req.num_tokens)
            if n == 0:
                continue
            if id(v) in chain_at:
                p = sampling_probs(logits[at : at + n], [req.params] * n)
                assert req.spec_draft is not None and req.spec_draft.probs is not None
                q = req.spec_draft.probs.to(p.device)
                tokens, accepted = accept_sampled(drafts, q, p, req.generator)
                v.tokens = tokens
                if req.params.logprobs is not None:
                    ids = torch.tensor(tokens, dtype=torch.int64, device=logits.device)
                    v.logprobs = token_logprobs(
                        logits[at : at + len(tokens)], ids, [req.params] * len(tokens)
                    )  # type: ignore[assignment]
            else:
                target = [picked[at + i][0] for i in range(n)]
                accepted = self._accepted(drafts, target)
                v.tokens = target[: accepted + 1]
                if req.params.logprobs is not None:
                    v.logprobs = [picked[at + i][1] for i in range(accepted + 1)]  # type: ignore[misc]
            if drafts:
                self._count(req, len(drafts), accepted)
            at += n

    def _accepted(self, drafts: list[int], target: list[int]) -> int:
        forced = self.config.forced_acceptance
        if forced is None or not drafts:
            return accept_greedy(drafts, target)
        accepted = 0
        while accepted < len(drafts) and self._forced.random() < forced:
            accepted += 1
        return accepted

    def _count(self, req: Request, num_drafts: int, accepted: int) -> None:
        self.num_verifications += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += accepted
        self.accepted_histogram[accepted] += 1
        req.num_spec_draft_tokens += num_drafts
        req.num_spec_accepted_tokens += accepted
        req.num_spec_verifications += 1

    def _valid_drafts(self, req: Request) -> list[int]:
        proposal = req.spec_draft
        if proposal is None or proposal.num_tokens != req.num_tokens:
            return []
        return proposal.token_ids[: self._num_drafts(req)]

    def _num_drafts(self, req: Request) -> int:
        """Drafts worth making for ``req`` now: at most K, none past its last token."""
        if not drafts_allowed(req):
            return 0
        if req.prefill_only:
            return self._num_handoff_drafts(req)
        left = min(
            req.params.max_new_tokens - len(req.output_ids), req.max_total_tokens - req.num_tokens
        )
        return max(0, min(self.config.num_draft_tokens, left - 1))

    # ---- draft ----------------------------------------------------------------------------

    def draft(self, verified: list[Verified]) -> None:
        """Run the MTP layer over the positions the step computed (after booking) and chain
        the next drafts of every request still decoding."""
        greedy, self._greedy = self._greedy, None
        if greedy is not None:
            self._draft_greedy(verified, greedy)
            return
        hidden = self._hidden
        self._hidden = None
        assert hidden is not None
        seqs: list[SequenceChunk] = []
        rows: list[int] = []
        last_rows: dict[int, Request] = {}  # row of the draft batch -> request that drafts
        for v in verified:
            req = v.request
            # A prefill instance's request ends at its first token ("prefilled"), but the MTP
            # still runs over its prompt: that draft KV crosses the handoff with its pages.
            prefilled = req.prefill_only and req.finish_reason == "prefilled"
            running = req.status is RequestStatus.RUNNING
            if not (running or prefilled) or not drafts_allowed(req):
                req.spec_draft = None
                continue
            assert req.page_table is not None
            m = req.num_computed - v.start  # positions with a valid target hidden state
            if m <= 0:
                continue
            ids = _tokens(req, v.start + 1, v.start + m + 1)
            if v.decoding:
                seqs += [SequenceChunk([t], v.start + i, req.page_table) for i, t in enumerate(ids)]
            else:
                seqs.append(SequenceChunk(ids, v.start, req.page_table))
            rows += range(v.row, v.row + m)
            if (running and not req.is_prefilling) or prefilled:  # prefilled: handoff drafts
                last_rows[len(rows) - 1] = req
        if not seqs:
            return
        index = torch.tensor(rows, dtype=torch.int64, device=hidden.device)
        g, logits = self._draft_forward(seqs, hidden.index_select(0, index), 0)
        chain = []
        for r, req in last_rows.items():
            k = self._room_for_drafts(req)
            req.spec_draft = None
            if k > 0:
                chain.append((req, k, r))
        if chain:
            self._chain(chain, g, logits)

    def _draft_greedy(self, verified: list[Verified], step: GreedyStep) -> None:
        """:meth:`draft` after :meth:`_verify_greedy`: the drafts it made, cut to each
        running request's limits and pages, or the chain from its first drafts."""
        page = self.config.page_size
        chain = []
        for i, v in enumerate(verified):
            req = v.request
            req.spec_draft = None
            if req.status is not RequestStatus.RUNNING:
                continue
            if step.drafts is None:
                k = self._room_for_drafts(req)
                if k > 0:
                    chain.append((req, k, i))
                continue
            # the chain's clamped positions: draft j + 1 came from position num_tokens - 2 + j
            k = min(self._num_drafts(req), len(req.pages) * page - req.num_tokens + 2)
            if k > 0:
                req.spec_draft = DraftProposal(req.num_tokens, step.drafts[i][:k], None)
        if chain:
            assert step.g is not None and step.logits is not None
            self._chain(chain, step.g, step.logits)

    def _draft_forward(
        self, seqs: list[SequenceChunk], hidden: torch.Tensor, step: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The draft over ``seqs`` given ``hidden`` -> (g, logits): on the draft's graphs
        when every chunk is one token (and graphs are attached), else eagerly."""
        graphs = self._step_graphs(all(len(s.token_ids) == 1 for s in seqs), len(seqs))
        self._num_draft_forwards += 1
        if graphs is not None:
            group = self._group
            rows, pages = (1, 1) if group is None else (group.draft_rows(step), group.pages)
            try:
                return graphs.draft.run(*_rows(seqs), hidden, step, rows, pages)
            except GraphCaptureError:
                if self._in_group:  # the other ranks run this step on their graphs
                    raise
                log.exception("CUDA graphs off for speculative steps; they run eagerly")
                self.graphs = None
        return self.draft_model(self._batch(seqs), self.kv_pool, hidden, step, self._mode)

    def _room_for_drafts(self, req: Request) -> int:
        """K for ``req``, less what its pages cannot hold: drafting step j >= 2 writes the
        draft KV of position num_tokens + j - 3 (pages taken from free ones only)."""
        k = self._num_drafts(req)
        page = self.config.page_size
        if k > 1 and not self.scheduler.try_grow(req, req.num_tokens - 2 + k):
            k = max(1, min(k, len(req.pages) * page - req.num_tokens + 2))
        return k

    def _chain(
        self, chain: list[tuple[Request, int, int]], g: torch.Tensor, logits: torch.Tensor
    ) -> None:
        """Draft 1 from each request's row of ``logits``, then the rest one MTP step each."""
        reqs = [req for req, _, _ in chain]
        index = torch.tensor([r for _, _, r in chain], dtype=torch.int64, device=g.device)
        g, logits = g.index_select(0, index), logits.index_select(0, index)
        tokens: list[list[int]] = [[] for _ in reqs]
        probs: list[list[torch.Tensor]] = [[] for _ in reqs]
        step = 0
        live = list(range(len(reqs)))
        while True:
            picks = self._draw(logits, [reqs[i] for i in live])
            for j, i in enumerate(live):
                tokens[i].append(picks[j][0])
                if picks[j][1] is not None:
                    probs[i].append(picks[j][1])
            step += 1
            keep = [j for j, i in enumerate(live) if chain[i][1] > step]
            if not keep:
                break
            live = [live[j] for j in keep]
            seqs = []
            for i in live:
                req = reqs[i]
                assert req.page_table is not None
                # draft step + 1 sits at position num_tokens - 2 + step
                pos = req.num_tokens - 2 + step
                seqs.append(SequenceChunk([tokens[i][-1]], pos, req.page_table))
            keep_index = torch.tensor(keep, dtype=torch.int64, device=g.device)
            g, logits = self._draft_forward(seqs, g.index_select(0, keep_index), step)
        for i, req in enumerate(reqs):
            q = torch.stack(probs[i]) if probs[i] else None
            req.spec_draft = DraftProposal(req.num_tokens, tokens[i], q)

    def _draw(
        self, logits: torch.Tensor, reqs: list[Request]
    ) -> list[tuple[int, torch.Tensor | None]]:
        """One draft per row: the argmax for greedy requests, else a draw from q."""
        greedy = logits.argmax(dim=-1).tolist()
        out: list[tuple[int, torch.Tensor | None]] = []
        for i, req in enumerate(reqs):
            if req.params.temperature < GREEDY_BELOW:
                out.append((greedy[i], None))
                continue
            q = sampling_probs(logits[i : i + 1], [req.params])[0]
            out.append((draw(q, req.generator), q))
        return out

    # ---- the PD handoff: prefill's drafts for decode's first step ---------------------------

    def _num_handoff_drafts(self, req: Request) -> int:
        """Drafts a prefill instance makes for decode's first step: greedy requests only (a
        sampled draft is verified against the q it was drawn from, [k, vocab] float32, too
        heavy for the handoff), at most K, none past ``max_new_tokens``; decode trims them
        to its own limits (:meth:`_valid_drafts`)."""
        if req.params.temperature >= GREEDY_BELOW:
            return 0
        left = req.params.max_new_tokens - len(req.output_ids)
        return max(0, min(self.config.num_draft_tokens, left - 1))

    @staticmethod
    def handoff_drafts(req: Request) -> list[int]:
        """Prefill: the drafts a prefilled request hands to decode with its first token
        (greedy requests; empty for others)."""
        proposal = req.spec_draft
        if proposal is None or proposal.probs is not None or proposal.num_tokens != req.num_tokens:
            return []
        return list(proposal.token_ids)

    def take_handoff_drafts(self, req: Request, token_ids: Sequence[int]) -> None:
        """Decode: ``req`` was just activated, and prefill drafted ``token_ids`` after its
        first token; its first step verifies them, as the step after the prompt does on a
        single engine. Ignored for a request that does not draft greedily."""
        vocab = self.model.config.vocab_size
        ids = [int(t) for t in token_ids]
        if not ids or not all(0 <= t < vocab for t in ids):
            return
        if drafts_allowed(req) and req.params.temperature < GREEDY_BELOW:
            req.spec_draft = DraftProposal(req.num_tokens, ids, None)

    # ---- expert-parallel groups -------------------------------------------------------------

    def join_group(self, idle_page: list[int]) -> None:
        """This engine became one rank of an expert-parallel group, whose MTP layer's experts
        are spread over the ranks like the target's (dsmesh/engine/ep/runtime.py): each draft
        forward exchanges tokens with every rank. So in a step where any rank speculates,
        every rank runs the same draft forwards: its own, then padding ones
        (:meth:`pad_group_drafts`). In a step the group runs on the graph runners
        (:meth:`start_group_step`) every forward runs at the agreed buckets, a padding one
        over one row at position 0 of ``idle_page`` (a page the engine keeps for this);
        otherwise every forward is eager, a padding one empty."""
        self._in_group = True
        self._idle_page = idle_page
        hidden = self.draft_model.config.hidden_size
        dtype = self.draft_model.lm_head.weight.dtype
        self._idle_hidden = torch.zeros(1, hidden, dtype=dtype, device=self.device)

    def group_graph_shape(self, chunks: list[ScheduledChunk]) -> tuple[int, int, int] | None:
        """What this rank's speculative step of ``chunks`` needs of a group's graph step
        (:class:`GroupBuckets`): its verify rows (each request's token and drafts), the pages
        its forwards read (at most: its requests' pages, and those of every position its
        verify and chain may reach, before the step takes them) and its requests (the
        chain's rows); None when it cannot run on the graphs (prompt chunks, too many rows,
        no graphs). Call it just before :meth:`verify`: the drafts it counts are the ones
        verify feeds."""
        graphs = self.graphs
        if graphs is None or any(c.request.is_prefilling for c in chunks):
            return None
        k = self.config.num_draft_tokens
        rows = pages = 0
        for c in chunks:
            req = c.request
            drafts = len(self._valid_drafts(req))
            rows += 1 + drafts
            reach = min(req.num_computed + drafts + k, req.max_total_tokens)
            pages = max(pages, len(req.pages), pages_for(reach, self.config.page_size))
        if not graphs.fits(rows) or pages > graphs.target.inputs.max_pages:
            return None
        return rows, pages, len(chunks)

    def start_group_step(self, group: GroupBuckets | None) -> None:
        """A step of the group begins: its forwards run on the graph runners at ``group``'s
        buckets (every rank's agreed ones), or eagerly when None."""
        if group is not None and self.graphs is None:
            raise ValueError("a group graph step needs this rank's draft graphs")
        self._group = group
        self._num_draft_forwards = 0

    @property
    def num_group_draft_forwards(self) -> int:
        """Draft forwards of a speculative step, the most one rank can need: the pass over
        the step's positions, then up to K - 1 chain steps."""
        return self.config.num_draft_tokens

    def pad_group_drafts(self) -> None:
        """After this rank's step (speculative, plain or idle) in a step where the group
        speculates: padding draft forwards until it ran :attr:`num_group_draft_forwards`,
        each on the MTP layer (and, on the graphs, at the bucket) a real forward at that
        place of the chain would use. Their output is dropped; on the graphs they write the
        draft KV of the idle page only."""
        group = self._group
        empty = ForwardBatch.empty(self.device)
        nothing = torch.empty(0, self.draft_model.config.hidden_size, device=self.device)
        while self._num_draft_forwards < self.num_group_draft_forwards:
            step = self._num_draft_forwards
            if group is None:
                self.draft_model(empty, self.kv_pool, nothing, step, self._mode)
            else:
                assert self.graphs is not None and self._idle_hidden is not None
                rows, pages = group.draft_rows(step), group.pages
                idle = self._idle_hidden
                self.graphs.draft.run([0], [0], [self._idle_page], idle, step, rows, pages)
            self._num_draft_forwards += 1
        self._num_draft_forwards = 0

    def _step_graphs(self, single: bool, num_rows: int) -> SpecGraphs | None:
        """The graphs a verify or draft forward of ``num_rows`` rows (``single``: one token
        each) runs on, None for eagerly. In a group: whatever the group agreed for the step
        (on the graphs, this rank voted that its rows are single and fit)."""
        graphs = self.graphs
        if graphs is None:
            return None
        if self._in_group:
            if self._group is None:
                return None
            assert single and graphs.fits(num_rows)
            return graphs
        return graphs if single and graphs.fits(num_rows) else None

    # ---- helpers --------------------------------------------------------------------------

    @property
    def _mode(self) -> str:
        return self.config.attention_mode

    def _batch(self, seqs: list[SequenceChunk]) -> ForwardBatch:
        # the model plans its decode attention backend itself
        # (dsmesh/engine/model/mla_decode_backend.py)
        return ForwardBatch.build(seqs, self.config.page_size, self.device)


def _rows(seqs: list[SequenceChunk]) -> tuple[list[int], list[int], list[np.ndarray]]:
    """Single-token chunks as a graph runner's rows: (token ids, positions, pages)."""
    pages = [s.page_table.numpy() for s in seqs]
    return [s.token_ids[0] for s in seqs], [s.prefix_len for s in seqs], pages


def _tokens(req: Request, start: int, end: int) -> list[int]:
    """Tokens ``[start, end)`` of prompt + output, without copying the whole prompt."""
    n_prompt = len(req.prompt_ids)
    if end <= n_prompt:
        return req.prompt_ids[start:end]
    if start >= n_prompt:
        return req.output_ids[start - n_prompt : end - n_prompt]
    return req.prompt_ids[start:] + req.output_ids[: end - n_prompt]
