"""One engine's part of an expert-parallel group's step: what the ranks agree on first.

The ranks of a group run their MoE layers' collectives together, so every forward of a step
must pair up across them. Before each step the ranks vote once (on the host, over gloo:
:class:`GroupVote`): whether every rank can replay a decode graph (decode-only or idle, within
the buckets), and at which (rows, pages) bucket, the largest any rank needs; whether any rank
speculates, and at which buckets its verify and draft forwards run. A rank with nothing to
run replays one row over a page of its own, or runs an empty forward, and pads the draft
forwards. Launching the next decode step ahead is voted the same way: every rank launches
only when all can, at the largest bucket.
"""

from __future__ import annotations

from typing import Protocol

from dsmesh.engine.kv.pool import pages_for
from dsmesh.engine.runner.model_runner import ModelRunner, scores_prompt
from dsmesh.engine.sched.scheduler import ScheduledChunk
from dsmesh.engine.speculative.graphs import GroupBuckets
from dsmesh.engine.speculative.worker import MTPSpeculator


class GroupVote(Protocol):
    """One all-reduce of the group (by MAX) over this rank's ``busy`` and ``flags``, which
    every rank calls at the same points (dsmesh/engine/ep/runtime.py implements it)."""

    def vote(self, busy: bool, flags: list[int]) -> tuple[bool, list[int]]: ...


class GroupLockstep:
    """Agrees with the other ranks of a group on each step's graphs, drafts and launches.
    Not thread-safe: the engine thread only."""

    def __init__(
        self, vote: GroupVote, runner: ModelRunner, speculator: MTPSpeculator | None
    ) -> None:
        self.vote = vote
        self.runner = runner
        self.speculator = speculator
        self.drafts = False  # this step speculates on some rank

    def agree_on_graphs(
        self, chunks: list[ScheduledChunk], speculates: bool
    ) -> tuple[int, int] | None:
        """One all-reduce: (rows, pages) of this step's graph when every rank of the group
        can replay one (decode-only or idle, within the buckets), else None. ``speculates``:
        this rank's step of ``chunks`` is speculative. The same vote sets :attr:`drafts`:
        whether any rank speculates in this step, and the buckets of the speculative step's
        draft forwards (MTPSpeculator.start_group_step)."""
        runner = self.runner.graph_runner
        spec = self.speculator
        rows, pages, chain_rows = len(chunks), 1, 0
        if chunks and runner is not None:
            pages = pages_for(max(c.request.num_computed for c in chunks) + 1, runner.page_size)
        if speculates:  # verify rows, the pages of every forward, the chain's rows
            assert spec is not None
            shape = spec.group_graph_shape(chunks)
            mine = runner is not None and shape is not None
            if shape is not None:
                rows, pages, chain_rows = shape
        else:
            mine = runner is not None and (
                not chunks
                or (
                    runner.can_run(rows)
                    and all(c.num_tokens == 1 for c in chunks)
                    and not any(scores_prompt(c) for c in chunks)
                )
            )
        # where the group speculates, every rank's draft forwards replay its draft graphs
        mine = mine and (spec is None or spec.graphs is not None)
        flags = [int(not mine), rows, pages, int(speculates), chain_rows]
        _, (refuse, max_rows, max_pages, drafts, max_chain) = self.vote.vote(False, flags)
        self.drafts = bool(drafts)
        bucket = None if refuse or runner is None else (max(max_rows, 1), max_pages)
        if spec is not None:
            group = None
            if bucket is not None and drafts:
                group = GroupBuckets(bucket[0], bucket[1], max(max_chain, 1))
            spec.start_group_step(group)
        return bucket

    def may_launch_ahead(self, bucket: tuple[int, int] | None) -> bool:
        """A step the group runs on the graphs (``bucket``) with no rank speculating: one
        that may launch the next ahead (:meth:`agree_on_launch`)."""
        return bucket is not None and not self.drafts

    def agree_on_launch(self, certain: bool, positions: list[int]) -> tuple[int, int] | None:
        """One vote of the group: the (rows, pages) bucket at which every rank launches its
        next decode step now, or None when any rank cannot (``certain``: this rank can,
        feeding its rows at ``positions``)."""
        assert self.runner.graph_runner is not None
        pages = pages_for(max(positions, default=0) + 1, self.runner.graph_runner.page_size)
        flags = [int(not certain), len(positions), pages]
        _, (refuse, rows, max_pages) = self.vote.vote(False, flags)
        return None if refuse else (max(rows, 1), max_pages)

    def decline_launch_ahead(self, bucket: tuple[int, int] | None) -> None:
        """This rank's vote against launching ahead, in a group graph step it does not run
        overlapped (every rank votes once in such a step: :meth:`agree_on_launch`)."""
        if self.may_launch_ahead(bucket):
            self.agree_on_launch(False, [])

    def idle_graph_step(self, bucket: tuple[int, int]) -> None:
        """This rank's part of a group graph step with nothing to run (ModelRunner)."""
        self.runner.idle_graph_step(bucket)

    def pad_drafts(self) -> None:
        """In a step where the group speculates: this rank's draft forwards up to the
        group's count (MTPSpeculator.pad_group_drafts)."""
        if self.drafts:
            assert self.speculator is not None
            self.speculator.pad_group_drafts()
