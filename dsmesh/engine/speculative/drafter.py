"""The draft half of a speculative step: the MTP layer over the positions the step computed,
and the chain of the next drafts.

After the engine booked the verified tokens, the MTP layer runs over every position whose
target hidden state the step produced (pairs ``(h[p], x[p + 1])``, writing the draft's KV
there), which yields the first draft; ``k - 1`` more single-token MTP steps chain from the
draft's own hidden state. The drafts wait on the request (:class:`DraftProposal`) for the
next step. A greedy step on the graphs drafted on the device already; here its drafts are cut
to each request's limits.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dsmesh.engine.model.forward_batch import SequenceChunk
from dsmesh.engine.request import Request, RequestStatus
from dsmesh.engine.sampling.sampler import GREEDY_BELOW
from dsmesh.engine.sched.scheduler import Scheduler
from dsmesh.engine.speculative.acceptance import draw, sampling_probs
from dsmesh.engine.speculative.config import SpeculativeConfig
from dsmesh.engine.speculative.graphs import GreedyStep
from dsmesh.engine.speculative.proposal import (
    DraftProposal,
    drafts_allowed,
    num_drafts,
    tokens_between,
)
from dsmesh.engine.speculative.runner import SpecRunner
from dsmesh.engine.speculative.verifier import Verified, VerifiedStep


class Drafter:
    """Drafts the next tokens of every request still decoding. Not thread-safe."""

    def __init__(self, config: SpeculativeConfig, runner: SpecRunner, scheduler: Scheduler):
        self.config = config
        self.runner = runner
        self.scheduler = scheduler

    def draft(self, step: VerifiedStep) -> None:
        """Run the MTP layer over the positions the step computed (after booking) and chain
        the next drafts of every request still decoding."""
        if step.greedy is not None:
            self._draft_greedy(step.chunks, step.greedy)
            return
        hidden = step.hidden
        assert hidden is not None
        seqs: list[SequenceChunk] = []
        rows: list[int] = []
        last_rows: dict[int, Request] = {}  # row of the draft batch -> request that drafts
        for v in step.chunks:
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
            ids = tokens_between(req, v.start + 1, v.start + m + 1)
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
        g, logits = self.runner.draft_forward(seqs, hidden.index_select(0, index), 0)
        chain = []
        for r, req in last_rows.items():
            k = self._room_for_drafts(req)
            req.spec_draft = None
            if k > 0:
                chain.append((req, k, r))
        if chain:
            self._chain(chain, g, logits)

    def _draft_greedy(self, verified: list[Verified], step: GreedyStep) -> None:
        """:meth:`draft` after a greedy step on the graphs: the drafts it made, cut to each
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
            k = min(
                num_drafts(req, self.config.num_draft_tokens),
                len(req.pages) * page - req.num_tokens + 2,
            )
            if k > 0:
                req.spec_draft = DraftProposal(req.num_tokens, step.drafts[i][:k], None)
        if chain:
            assert step.g is not None and step.logits is not None
            self._chain(chain, step.g, step.logits)

    def _room_for_drafts(self, req: Request) -> int:
        """K for ``req``, less what its pages cannot hold: drafting step j >= 2 writes the
        draft KV of position num_tokens + j - 3 (pages taken from free ones only)."""
        k = num_drafts(req, self.config.num_draft_tokens)
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
            g, logits = self.runner.draft_forward(seqs, g.index_select(0, keep_index), step)
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

    def take_handoff_drafts(self, req: Request, token_ids: Sequence[int]) -> None:
        """Decode: ``req`` was just activated, and prefill drafted ``token_ids`` after its
        first token; its first step verifies them, as the step after the prompt does on a
        single engine. Ignored for a request that does not draft greedily."""
        vocab = self.runner.model.config.vocab_size
        ids = [int(t) for t in token_ids]
        if not ids or not all(0 <= t < vocab for t in ids):
            return
        if drafts_allowed(req) and req.params.temperature < GREEDY_BELOW:
            req.spec_draft = DraftProposal(req.num_tokens, ids, None)
