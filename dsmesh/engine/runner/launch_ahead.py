"""Overlapped decode: the next greedy decode step launched before this one's bookkeeping.

With CUDA graphs, a decode-only step whose every row takes the argmax of its logits can
launch the step after it at once, its input tokens taken on the device from the step still
running, so the host's work of a step (booking, scheduling, the next step's inputs) overlaps
the GPU's. Only when the next step is certain: the same requests, one token each, no
admission, and every next KV slot in pages already held (``overlap_decode``, docs/GPU.md).
Grammar-constrained rows take their argmax over the logits masked once the previous step's
tokens have advanced their grammars. Tokens come back to the caller, who books them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from dsmesh.engine.request import Request, RequestStatus
from dsmesh.engine.runner.decode_graphs import GraphCaptureError
from dsmesh.engine.runner.model_runner import ModelRunner
from dsmesh.engine.sampling.grammar import GrammarMasks
from dsmesh.engine.sampling.params import SamplingParams
from dsmesh.engine.sampling.sampler import GREEDY_BELOW
from dsmesh.engine.sampling.token_mask import apply_token_bitmask
from dsmesh.engine.sched.scheduler import ScheduledChunk, Scheduler

# A decoded row: the request, its token, and the positions whose KV the step wrote.
Decoded = tuple[Request, int, tuple[int, int]]
# An expert-parallel group's vote on launching ahead: (this rank can, its rows' positions)
# -> the (rows, pages) bucket every rank launches at, None when some rank cannot.
LaunchVote = Callable[[bool, list[int]], "tuple[int, int] | None"]


@dataclass
class Inflight:
    """A launched decode step: row i fed ``reqs[i]`` at ``positions[i]``; its greedy tokens
    are ``tokens`` on the device and, once ``event`` has passed, ``host``. A step with
    constrained rows (a grammar) keeps its ``logits`` until :meth:`LaunchAhead._resolve`
    masks them, once the previous step's tokens have advanced the grammars."""

    reqs: list[Request]
    positions: list[int]
    logits: torch.Tensor | None
    tokens: torch.Tensor | None = None
    host: torch.Tensor | None = None
    event: torch.cuda.Event | None = None


def plain_argmax(params: SamplingParams) -> bool:
    """The token is the argmax of the raw logits, or of the logits masked by the request's
    grammar (structured outputs), and nothing else is reported about it."""
    return (
        params.temperature < GREEDY_BELOW and not params.adjusts_logits and params.logprobs is None
    )


def reaches_limit(req: Request) -> bool:
    """The token a decode step is computing for ``req`` is its last: ``max_new_tokens`` or
    ``max_total_tokens`` is reached with it."""
    return (
        len(req.output_ids) + 1 >= req.params.max_new_tokens
        or req.num_tokens + 1 >= req.max_total_tokens
    )


class LaunchAhead:
    """Launches decode steps ahead on ``runner``'s graphs and resolves their greedy tokens.
    ``scheduler`` says whether the next step is certain and gives its pages; ``grammar``
    masks constrained rows. In an expert-parallel group, ``vote`` agrees on each launch.
    Not thread-safe: the engine thread only."""

    def __init__(self, runner: ModelRunner, scheduler: Scheduler, grammar: GrammarMasks) -> None:
        self.runner = runner
        self.scheduler = scheduler
        self.grammar = grammar
        self.vote: LaunchVote | None = None
        self.inflight: Inflight | None = None  # a decode step launched ahead
        self.num_launched_ahead = 0  # decode steps launched before the previous one's end

    def can_launch(self, chunks: list[ScheduledChunk]) -> bool:
        """A decode-only step of the graph runner whose every row is a plain argmax of the
        logits (greedy, no logit adjustment, no logprobs): the step to launch ahead from."""
        runner = self.runner.graph_runner
        return (
            self.runner.config.overlap_decode
            and runner is not None
            and runner.can_run(len(chunks))
            and all(c.num_tokens == 1 and not c.request.is_prefilling for c in chunks)
            and all(plain_argmax(c.request.params) for c in chunks)
        )

    def decode(self, reqs: list[Request], bucket: tuple[int, int] | None) -> list[Decoded]:
        """Run a decode step of ``reqs`` on the graphs (at least the group's ``bucket``),
        launch the next when it is certain, and return this step's tokens. A capture
        failure of this step's graph raises GraphCaptureError before anything ran."""
        current = self._launch(reqs, [r.num_computed for r in reqs], None, bucket)
        self._resolve(current)
        self._launch_next(current, list(range(len(reqs))))
        return self._finish_rows(current, list(range(len(reqs))))

    def finish(self) -> list[Decoded] | None:
        """Finish the step launched ahead: rows whose request stopped (finished at the
        previous step, or aborted) are dropped. None when no row is left, outside a group
        (in one, every rank launched the step together and votes on the next: [])."""
        current, self.inflight = self.inflight, None
        assert current is not None
        rows = [
            i
            for i, r in enumerate(current.reqs)
            if r.status is RequestStatus.RUNNING and r.num_computed == current.positions[i]
        ]
        if not rows and self.vote is None:
            return None
        self._resolve(current, rows)
        self._launch_next(current, rows)
        return self._finish_rows(current, rows)

    def settle(self) -> None:
        """Wait until a step launched ahead has run. Its rows of requests that stopped since
        write one KV slot into pages already freed; stream order keeps the engine's own
        later writes after it, but a reserved request's pages are filled by the KV transfer,
        outside the stream, so they must not be handed out while that write is pending."""
        if self.inflight is not None and self.inflight.event is not None:
            self.inflight.event.synchronize()

    def _next_is_certain(self, reqs: list[Request], positions: list[int], leaving: int) -> bool:
        """The step after this one (feeding ``reqs[i]`` at ``positions[i]``) will run exactly
        ``reqs``, one token each, unless one of them samples a stop token: the only other
        running requests are the ``leaving`` ones that reach their length limit in this
        step, the scheduler would admit no waiting request (none waits, the batch stays
        full, or admissions wait out ``admit_interval``), and the next token's KV slot lies
        in pages each holds (taken now, from free pages only: a step that would need a
        retraction is left to the scheduler)."""
        sched = self.scheduler
        if len(sched.running) != len(reqs) + leaving or sched.may_admit_next_step(leaving):
            return False
        return all(sched.try_grow(r, p + 1) for r, p in zip(reqs, positions, strict=True))

    def _launch(
        self,
        reqs: list[Request],
        positions: list[int],
        device_ids: torch.Tensor | None,
        bucket: tuple[int, int] | None,
    ) -> Inflight:
        """Replay the decode graph for ``reqs`` at ``positions`` (input tokens from the
        requests, or ``device_ids`` on the device; at least the group's ``bucket``) and
        start copying its greedy tokens to the host; nothing here waits for the GPU."""
        runner = self.runner.graph_runner
        assert runner is not None
        ids = [0] * len(reqs) if device_ids is not None else [r.pending_ids(1)[0] for r in reqs]
        rows, pages = bucket or (1, 1)
        logits = runner.run(
            ids,
            positions,
            [r.pages_array() for r in reqs],
            device_ids,
            min_rows=rows,
            min_pages=pages,
        )
        current = Inflight(reqs, positions, logits)
        if all(r.grammar is None for r in reqs):
            self._resolve(current)
        return current

    def _resolve(self, current: Inflight, rows: list[int] | None = None) -> None:
        """Enqueue ``current``'s greedy tokens (masked by the grammars of ``rows``, default
        every row; the grammars must already hold the previous step's tokens) and their copy
        to the host. The masks are computed on the host while the step runs on the GPU."""
        if current.tokens is not None:
            return
        assert current.logits is not None
        logits = current.logits
        if any(r.grammar is not None for r in current.reqs):
            keep = set(range(len(current.reqs)) if rows is None else rows)
            matchers = [r.grammar if i in keep else None for i, r in enumerate(current.reqs)]
            logits = apply_token_bitmask(logits, self.grammar.masks(matchers))
        tokens = logits.argmax(dim=-1)
        if tokens.is_cuda:
            host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            host.copy_(tokens, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            host, event = tokens, None
        current.logits, current.tokens, current.host, current.event = None, tokens, host, event

    def _launch_next(self, current: Inflight, rows: list[int]) -> None:
        """Launch the step after ``current`` for its rows ``rows`` (row order kept), less
        those whose request reaches its length limit with this step's token, fed the tokens
        ``current`` is computing, when that step is certain."""
        continuing = [i for i in rows if not reaches_limit(current.reqs[i])]
        leaving = len(rows) - len(continuing)
        rows = continuing
        reqs = [current.reqs[i] for i in rows]
        positions = [current.positions[i] + 1 for i in rows]
        certain = bool(reqs) and self._next_is_certain(reqs, positions, leaving)
        bucket = None
        if self.vote is not None:
            bucket = self.vote(certain, positions)
            certain = bucket is not None
        if not certain:
            return
        assert current.tokens is not None  # resolved before the next step launches
        if len(rows) == len(current.reqs):
            device_ids = current.tokens
        else:
            index = torch.tensor(rows, dtype=torch.int64)
            if current.tokens.is_cuda:
                index = index.pin_memory().to(current.tokens.device, non_blocking=True)
            device_ids = current.tokens.index_select(0, index)
        try:
            self.inflight = self._launch(reqs, positions, device_ids, bucket)
            self.num_launched_ahead += 1
            self.scheduler.count_unscheduled_step()
        except GraphCaptureError:
            self.runner.drop_graphs()

    def _finish_rows(self, current: Inflight, rows: list[int]) -> list[Decoded]:
        """Wait for ``current``'s tokens; each of the given rows fed one token."""
        if current.event is not None:
            current.event.synchronize()
        assert current.host is not None
        tokens = current.host.tolist()
        decoded: list[Decoded] = []
        for i in rows:
            req = current.reqs[i]
            req.num_computed += 1
            decoded.append((req, tokens[i], (req.num_computed - 1, req.num_computed)))
        return decoded
