"""The verify half of a speculative step: one target forward over the scheduled step, and the
tokens each request emits (not booked).

A decoding request feeds its last token and its drafts, each as its own row of the batch (a
row per position, context growing by one: causal attention over the paged cache through the
batched decode path, exactly the attention a plain decode step computes). Prompt chunks run
as usual. Which drafts are kept follows :mod:`dsmesh.engine.speculative.acceptance`: greedy rows go
through the engine's sampler with every logit adjustment, sampled chains through rejection
sampling. A decode-only step whose every request takes the argmax runs on the graphs with
one host sync, verifying and drafting on the device (:meth:`SpecGraphs.greedy_step`).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dsmesh.engine.model.forward_batch import SequenceChunk
from dsmesh.engine.request import Request
from dsmesh.engine.runner.decode_graphs import GraphCaptureError
from dsmesh.engine.sampling.sampler import GREEDY_BELOW, Sampler, token_logprobs
from dsmesh.engine.sampling.token_logprobs import TokenLogprobs
from dsmesh.engine.sched.scheduler import ScheduledChunk, Scheduler
from dsmesh.engine.speculative.acceptance import accept_greedy, accept_sampled, sampling_probs
from dsmesh.engine.speculative.config import SpeculativeConfig
from dsmesh.engine.speculative.graphs import GreedyStep, SpecGraphs
from dsmesh.engine.speculative.proposal import takes_argmax, valid_drafts
from dsmesh.engine.speculative.runner import SpecRunner, graph_rows

# the allowed-token bitmask of the rows sampled for these requests, or None (no grammar)
AllowedTokens = Callable[[list[Request]], torch.Tensor | None]


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
    """One scheduled chunk after the verify. ``tokens`` are the tokens to book (empty
    mid-prompt); booking token j leaves ``num_computed = first_computed + j``."""

    request: Request
    start: int  # num_computed before the step
    row: int  # the chunk's first row of the step's hidden states
    num_fed: int
    first_computed: int
    tokens: list[int]
    logprobs: list[TokenLogprobs] | None
    decoding: bool  # a decode (verify) row, not a prompt chunk


@dataclass
class VerifiedStep:
    """What the verify hands the draft: each chunk (in order), and either the target's
    hidden states [rows fed, hidden] or, for a greedy step on the graphs, its drafts."""

    chunks: list[Verified]
    hidden: torch.Tensor | None = None
    greedy: GreedyStep | None = None


class Verifier:
    """Verifies the drafts of a step and counts what was accepted. Not thread-safe."""

    def __init__(
        self,
        config: SpeculativeConfig,
        runner: SpecRunner,
        scheduler: Scheduler,
        sampler: Sampler,
    ) -> None:
        self.config = config
        self.runner = runner
        self.scheduler = scheduler
        self.sampler = sampler
        self._forced = random.Random(0)
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

    def verify(self, chunks: list[ScheduledChunk], allowed_tokens: AllowedTokens) -> VerifiedStep:
        """The target forward over ``chunks`` and the tokens each emits (not booked)."""
        k = self.config.num_draft_tokens
        seqs: list[SequenceChunk] = []
        plan: list[tuple[Verified, list[int]]] = []
        row = 0  # rows of the hidden states: one per token fed
        for c in chunks:
            req = c.request
            assert req.page_table is not None
            start = req.num_computed
            decoding = not req.is_prefilling
            drafts = valid_drafts(req, k) if decoding else []
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
        verified = [v for v, _ in plan]
        runner = self.runner
        graphs = runner.step_graphs(all(v.decoding for v in verified), len(seqs))
        if graphs is not None:
            try:
                if all(takes_argmax(v.request) for v in verified):
                    return VerifiedStep(verified, greedy=self._verify_greedy(graphs, plan))
                # every row's logits, in order: the rows _choose wants
                logits, hidden = graphs.verify(*graph_rows(seqs), runner.group)
                self._choose(plan, logits, allowed_tokens)
                return VerifiedStep(verified, hidden=hidden)
            except GraphCaptureError:  # nothing booked yet: the eager forward redoes it
                if runner.in_group:  # the other ranks run this step on their graphs
                    raise
                runner.drop_graphs()
        hidden = runner.verify_eager(seqs)

        # Rows whose logits are needed: every verify row, the last row of a finished prompt.
        wanted: list[int] = []
        for v, _ in plan:
            if v.decoding:
                wanted += range(v.row, v.row + v.num_fed)
            elif v.first_computed == v.request.num_tokens:
                wanted.append(v.row + v.num_fed - 1)
        if wanted:
            index = torch.tensor(wanted, dtype=torch.int64, device=hidden.device)
            logits = runner.model.compute_logits(hidden.index_select(0, index))
            self._choose(plan, logits, allowed_tokens)
        return VerifiedStep(verified, hidden=hidden)

    def _verify_greedy(
        self, graphs: SpecGraphs, plan: list[tuple[Verified, list[int]]]
    ) -> GreedyStep:
        """A decode-only step whose every request takes the argmax: verified and drafted on
        the graphs with one host sync (:meth:`SpecGraphs.greedy_step`); its drafts wait in
        the returned step for the draft half. Chained drafts placed on the device need pages
        for every position they may write, taken now (from free pages only)."""
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
            self.runner.group,
        )
        self.runner.num_draft_forwards += k if on_device else 1  # the first draft, the chain
        for (v, drafts), tokens, accepted in zip(plan, step.tokens, step.accepted, strict=True):
            v.tokens = tokens
            if drafts:
                self._count(v.request, len(drafts), accepted)
        return step

    def _choose(
        self,
        plan: list[tuple[Verified, list[int]]],
        logits: torch.Tensor,
        allowed_tokens: AllowedTokens,
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
