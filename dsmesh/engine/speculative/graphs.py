"""Speculative steps on CUDA graphs: the verify and draft forwards replayed per bucket, and
greedy steps resolved on the device with one host sync.

A decode-only speculative step is decode-shaped throughout: the verify forward feeds each
request's last token and its drafts one row per position (the model's
:class:`dsmesh.engine.runner.cuda_graph.CudaGraphRunner`), and the draft forwards feed one row per
position too (:class:`dsmesh.engine.speculative.mtp_graph.MTPGraphRunner`, over the same input
buffers). A step where every request takes the argmax (greedy, no logit adjustment, no logprobs, no
grammar) needs the host only at its end (:meth:`SpecGraphs.greedy_step`):

1. verify: the model replays the rows; ``t`` = each row's argmax;
2. acceptance on the device (:func:`dsmesh.engine.speculative.acceptance.accept_greedy_rows`), or,
for the
   benchmark's forced acceptance, counts drawn on the host before the step;
3. first draft: the draft replays the same rows fed ``t`` (row ``j`` of a request at position
   ``p + j`` feeds ``t_j``, the token at ``p + j + 1`` when ``j <= a``, the accepted count).
   Rows past ``a`` write draft KV at positions the next step rewrites before it reads them;
   the first draft token is the argmax at row ``a``;
4. chain: ``K - 1`` steps of one row per request at positions ``p + a + j`` computed on the
   device, clamped into the request's pages (drafts past the clamp are dropped on the host).
   A decode backend that plans on the host (FlashInfer) needs those lengths on the host, so
   it leaves the chain to the host after the sync (``GreedyStep.drafts`` is None);
5. one copy to the host: every row's ``t``, the accepted counts and the drafts.

Other steps (sampled requests: rejection sampling needs the host) replay the same graphs
through :meth:`SpecGraphs.verify` and the draft runner's ``run``, choosing on the host.

In an expert-parallel group (``LLMEngine.join_group``) every forward is a collective, so the
ranks agree on :class:`GroupBuckets` before the step and run every forward at them, each rank
padding its own rows (or one row of its own, when it has none to run).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from dsmesh.engine.runner.cuda_graph import CudaGraphRunner
from dsmesh.engine.runner.decode_graphs import Outputs
from dsmesh.engine.speculative.acceptance import accept_greedy_rows
from dsmesh.engine.speculative.mtp_graph import MTPGraphRunner


@dataclass(frozen=True)
class GroupBuckets:
    """The buckets every rank of an expert-parallel group runs one speculative step's
    forwards at, agreed before it (the largest any rank needs), so that their collectives
    pair up and they capture and replay the same graphs: the target forward and draft
    forward 0 at (``rows``, ``pages``), the chained draft forwards 1 .. K - 1 at
    (``chain_rows``, ``pages``)."""

    rows: int
    pages: int
    chain_rows: int

    def draft_rows(self, step: int) -> int:
        """The rows of draft forward ``step`` (0: over the verify rows; then the chain)."""
        return self.rows if step == 0 else self.chain_rows


@dataclass
class GreedyStep:
    """A greedy speculative step after its one sync, per request of the step (in order).

    tokens: the target's tokens it emits (accepted drafts, then the target's next token).
    accepted: how many drafts it accepted.
    drafts: the next ``K`` drafts of each request (valid up to the room of its pages), or
        None when the chain is left to the host: ``g`` [n, hidden] and ``logits`` [n, vocab]
        are then the first draft's outputs at each request's last accepted row.
    """

    tokens: list[list[int]]
    accepted: list[int]
    drafts: list[list[int]] | None
    g: torch.Tensor | None = None
    logits: torch.Tensor | None = None


class SpecGraphs:
    """The model's and the draft's graph runners of a speculating engine (K drafts a step).
    Not thread-safe: the engine thread only."""

    def __init__(self, target: CudaGraphRunner, draft: MTPGraphRunner, num_draft_tokens: int):
        if draft.inputs is not target.inputs:
            raise ValueError("the draft runner must read the model runner's input buffers")
        self.target = target
        self.draft = draft
        self.k = num_draft_tokens

    @property
    def chain_on_device(self) -> bool:
        """Whether the chained drafts can be placed on the device (see the module doc)."""
        return not self.draft.decode_backend.plans_on_host

    def fits(self, num_rows: int) -> bool:
        return self.target.can_run(num_rows)

    def reset(self) -> None:
        self.target.reset()
        self.draft.reset()

    def verify(
        self,
        token_ids: Sequence[int],
        positions: Sequence[int],
        pages: Sequence[np.ndarray],
        group: GroupBuckets | None = None,
    ) -> Outputs:
        """The verify forward of a decode-only step's rows -> (logits [R, vocab] float32,
        final hidden states [R, hidden]), views of graph memory; at ``group``'s bucket in an
        expert-parallel group."""
        rows, pages_at_least = (group.rows, group.pages) if group is not None else (1, 1)
        return self.target.run_with_hidden(
            token_ids, positions, pages, min_rows=rows, min_pages=pages_at_least
        )

    def greedy_step(
        self,
        fed: Sequence[Sequence[int]],
        starts: Sequence[int],
        pages: Sequence[np.ndarray],
        limits: Sequence[int],
        forced: Sequence[int] | None,
        chain_on_device: bool,
        group: GroupBuckets | None = None,
    ) -> GreedyStep:
        """One greedy step of ``n`` requests. Request i feeds ``fed[i]`` (its last token, then
        its drafts) at positions ``starts[i]`` onwards, in ``pages[i]``; its chain may write
        up to position ``limits[i]`` (in its pages, at least ``starts[i] + len(fed[i])``
        when ``chain_on_device``). ``forced``: accepted counts drawn by the caller (the
        benchmark's forced acceptance), else the target's argmax decides. ``group``: the
        buckets of an expert-parallel group's step (every forward at least there)."""
        n, k = len(fed), self.k
        num_drafts = np.array([len(f) - 1 for f in fed], dtype=np.int64)
        first = np.concatenate([[0], np.cumsum(num_drafts + 1)[:-1]])
        ids = [t for f in fed for t in f]
        positions = [s + j for f, s in zip(fed, starts, strict=True) for j in range(len(f))]
        row_pages = [pg for f, pg in zip(fed, pages, strict=True) for _ in f]
        given = [first, num_drafts, starts, limits, starts if forced is None else forced]
        per_request = np.stack([np.asarray(x, dtype=np.int64) for x in given])
        r = len(ids)
        g_rows, g_pages, g_chain = (1, 1, 1)
        if group is not None:
            g_rows, g_pages, g_chain = group.rows, group.pages, group.chain_rows
        logits, hidden = self.target.run_with_hidden(
            ids, positions, row_pages, min_rows=g_rows, min_pages=g_pages
        )
        target_ids = logits.argmax(dim=-1)
        device = self.target.device
        first_d, drafts_d, starts_d, limits_d, forced_d = _to_device(per_request, device)
        if forced is None:  # before the first draft overwrites the fed ids
            fed_d = self.target.inputs.token_ids(r)
            accepted = accept_greedy_rows(fed_d, target_ids, first_d, drafts_d, k)
        else:
            accepted = forced_d
        g, draft_logits = self.draft.run_loaded(target_ids, hidden, step=0)
        last = first_d + accepted
        g, draft_logits = g.index_select(0, last), draft_logits.index_select(0, last)
        drafts = [draft_logits.argmax(dim=-1)]
        if chain_on_device and k > 1:
            p = self.draft.load_pages(pages, int(max(limits)) + 1, g_chain, g_pages)
            base = starts_d + accepted
            for j in range(1, k):
                positions_d = torch.minimum(base + j, limits_d)
                g, step_logits = self.draft.run_placed(p, positions_d, drafts[-1], g, j, g_chain)
                drafts.append(step_logits.argmax(dim=-1))
        host = torch.cat([target_ids, accepted, torch.stack(drafts, dim=1).flatten()]).tolist()
        t, a = host[:r], host[r : r + n]
        tokens = [t[first[i] : first[i] + a[i] + 1] for i in range(n)]
        if chain_on_device or k == 1:
            flat = host[r + n :]
            return GreedyStep(tokens, a, [flat[i * k : (i + 1) * k] for i in range(n)])
        return GreedyStep(tokens, a, None, g, draft_logits)


def _to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """Host -> device from pinned memory, ordered on the stream (no wait for the GPU)."""
    host = torch.from_numpy(np.ascontiguousarray(array))
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host
