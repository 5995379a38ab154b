"""The forwards of speculative steps: the target's verify and the MTP layer's drafts, eagerly
or on CUDA graphs, and, in an expert-parallel group, in step with the other ranks.

Decode-only steps replay graphs (dsmesh/engine/speculative/graphs.py): the verify on the model's
decode graphs, the drafts on the MTP layer's own over the same input buffers. Steps with
prompt chunks run eagerly. In a group every draft forward is a collective (the MTP layer's
experts are spread over the ranks), so every rank runs the same number of them in a step
where any rank speculates, padding with forwards of its own (:meth:`pad_group_drafts`).
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from dsmesh.engine.kv.pool import MLAKVPool, pages_for
from dsmesh.engine.model.deepseek import DeepseekForCausalLM
from dsmesh.engine.model.forward_batch import ForwardBatch, SequenceChunk
from dsmesh.engine.model.mtp import MTPDraft
from dsmesh.engine.runner.cuda_graph import CudaGraphRunner
from dsmesh.engine.runner.decode_graphs import GraphCaptureError
from dsmesh.engine.sched.scheduler import ScheduledChunk
from dsmesh.engine.speculative.config import SpeculativeConfig
from dsmesh.engine.speculative.graphs import GroupBuckets, SpecGraphs
from dsmesh.engine.speculative.mtp_graph import MTPGraphRunner
from dsmesh.engine.speculative.proposal import valid_drafts

log = logging.getLogger(__name__)


class SpecRunner:
    """Runs a speculating engine's verify and draft forwards; owns the speculative graphs
    and this rank's part of a group's step. Not thread-safe: the engine thread only."""

    def __init__(
        self,
        config: SpeculativeConfig,
        model: DeepseekForCausalLM,
        draft: MTPDraft,
        kv_pool: MLAKVPool,
        device: torch.device,
    ) -> None:
        self.config = config
        self.model = model
        self.draft_model = draft
        self.kv_pool = kv_pool
        self.device = device
        # CUDA graphs of decode-only steps (attach_graphs)
        self.graphs: SpecGraphs | None = None
        # expert-parallel groups (join_group): the step's agreed buckets (None: eager), the
        # draft forwards this rank ran in the step, and what its padding forwards feed
        self.in_group = False
        self.group: GroupBuckets | None = None
        self.num_draft_forwards = 0
        self._idle_page: list[int] = []
        self._idle_hidden: torch.Tensor | None = None

    # ---- graphs ---------------------------------------------------------------------------

    def attach_graphs(self, target: CudaGraphRunner, warmup_tokens: int = 0) -> None:
        """Run decode-only steps on ``target``'s graphs and the draft's own over the same
        buffers (dsmesh/engine/speculative/graphs.py), capturing the draft's buckets for contexts up
        to ``warmup_tokens`` now (before any request exists). A capture failure leaves the
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

    def step_graphs(self, single: bool, num_rows: int) -> SpecGraphs | None:
        """The graphs a verify or draft forward of ``num_rows`` rows (``single``: one token
        each) runs on, None for eagerly. In a group: whatever the group agreed for the step
        (on the graphs, this rank voted that its rows are single and fit)."""
        graphs = self.graphs
        if graphs is None:
            return None
        if self.in_group:
            if self.group is None:
                return None
            assert single and graphs.fits(num_rows)
            return graphs
        return graphs if single and graphs.fits(num_rows) else None

    def drop_graphs(self) -> None:
        """A capture failed before anything of the step was booked: run eagerly from now on
        (the caller redoes the forward eagerly). Not in a group, whose other ranks run the
        step on their graphs: there the failure propagates. Call it from the ``except``."""
        log.exception("CUDA graphs off for speculative steps; they run eagerly")
        self.graphs = None

    # ---- forwards -------------------------------------------------------------------------

    def verify_eager(self, seqs: list[SequenceChunk]) -> torch.Tensor:
        """The target's hidden states [rows, hidden] over ``seqs``, eagerly."""
        return self.model.hidden_states(
            self.batch(seqs), self.kv_pool, self.config.attention_mode, self.config.tbo
        )

    def draft_forward(
        self, seqs: list[SequenceChunk], hidden: torch.Tensor, step: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The draft over ``seqs`` given ``hidden`` -> (g, logits): on the draft's graphs
        when every chunk is one token (and graphs are attached), else eagerly."""
        graphs = self.step_graphs(all(len(s.token_ids) == 1 for s in seqs), len(seqs))
        self.num_draft_forwards += 1
        if graphs is not None:
            group = self.group
            rows, pages = (1, 1) if group is None else (group.draft_rows(step), group.pages)
            try:
                return graphs.draft.run(*graph_rows(seqs), hidden, step, rows, pages)
            except GraphCaptureError:
                if self.in_group:  # the other ranks run this step on their graphs
                    raise
                self.drop_graphs()
        mode = self.config.attention_mode
        return self.draft_model(self.batch(seqs), self.kv_pool, hidden, step, mode)

    def batch(self, seqs: list[SequenceChunk]) -> ForwardBatch:
        # the model plans its decode attention backend itself
        # (dsmesh/engine/model/mla_decode_backend.py)
        return ForwardBatch.build(seqs, self.config.page_size, self.device)

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
        self.in_group = True
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
        no graphs). Call it just before the verify: the drafts it counts are the ones the
        verify feeds."""
        graphs = self.graphs
        if graphs is None or any(c.request.is_prefilling for c in chunks):
            return None
        k = self.config.num_draft_tokens
        rows = pages = 0
        for c in chunks:
            req = c.request
            drafts = len(valid_drafts(req, k))
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
        self.group = group
        self.num_draft_forwards = 0

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
        group = self.group
        mode = self.config.attention_mode
        empty = ForwardBatch.empty(self.device)
        nothing = torch.empty(0, self.draft_model.config.hidden_size, device=self.device)
        while self.num_draft_forwards < self.num_group_draft_forwards:
            step = self.num_draft_forwards
            if group is None:
                self.draft_model(empty, self.kv_pool, nothing, step, mode)
            else:
                assert self.graphs is not None and self._idle_hidden is not None
                rows, pages = group.draft_rows(step), group.pages
                idle = self._idle_hidden
                self.graphs.draft.run([0], [0], [self._idle_page], idle, step, rows, pages)
            self.num_draft_forwards += 1
        self.num_draft_forwards = 0


def graph_rows(seqs: list[SequenceChunk]) -> tuple[list[int], list[int], list[np.ndarray]]:
    """Single-token chunks as a graph runner's rows: (token ids, positions, pages)."""
    pages = [s.page_table.numpy() for s in seqs]
    return [s.token_ids[0] for s in seqs], [s.prefix_len for s in seqs], pages
