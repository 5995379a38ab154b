"""Decode steps as CUDA graphs of the model's own forward, one per (batch bucket, page bucket).

A decode step (every request feeds one token) does the same work at every step of the same
batch size, so it is captured once and replayed, which removes the launch gaps of thousands
of small kernels per step. The runner re-implements nothing: it keeps fixed input buffers
(:class:`dsmesh.engine.runner.decode_graphs.DecodeInputs`: token ids, positions, KV slots and
lengths; one page table per page bucket), builds a :meth:`ForwardBatch.decode_only` over them and
captures ``model.hidden_states`` and ``model.compute_logits``, whose modules never synchronise with
the host on that path (dsmesh/engine/model/kernel_choice.py; MoE dispatch in its static mode).

A batch of ``n`` rows runs in the smallest bucket ``b >= n``; the padding rows repeat row 0
exactly (token, position, slot, pages), so they rewrite row 0's KV and change nothing. A row
is any single-token forward: a request's decode step, or one of the ``K + 1`` verify rows of
a speculative step (positions ``p .. p + K`` of one request, the same pages), which is why
the graphs also keep the final hidden states the MTP draft needs (:meth:`run_with_hidden`).
Before every run the decode backend gets the step's host page table
(``MLADecodeBackend.prepare_replay``: FlashInfer plans there). Graphs are captured when a
bucket is first needed, with that step's inputs in the buffers, or ahead of it: by
:meth:`CudaGraphRunner.warm_up` before the instance is ready, and by
:meth:`CudaGraphRunner.capture_deferred` after (dsmesh/engine/runner/graph_schedule.py); a
bucket queued for after ready runs uncaptured until then. Without CUDA, or with
``use_graphs=False``, the same forward runs uncaptured, which is how CPU tests check it.

With ``tbo`` the captured forward is the model's two-batch overlap (``hidden_states(...,
tbo=True)``) over the bucket's rows, split at half the bucket: the split is fixed by the
bucket, so each micro-batch's static dispatch has host-known shapes, and the graph records
the dispatcher's communication stream beside the compute (dsmesh/engine/ep/all_to_all.py). A
one-row bucket has nothing to split and runs the plain forward (every rank of a group runs
the same bucket, so their collectives still pair up).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from dsmesh.engine.kv.pool import MLAKVPool, pages_for
from dsmesh.engine.model.deepseek import DeepseekForCausalLM
from dsmesh.engine.model.mla_decode_backend import MLADecodeBackend
from dsmesh.engine.runner.decode_graphs import (
    DecodeGraphRunner,
    DecodeInputs,
    GraphCaptureError,
    Outputs,
)
from dsmesh.engine.runner.graph_schedule import DeferredCaptures, Key, capture_plan

__all__ = ["CudaGraphRunner", "GraphCaptureError", "graph_support_problem"]


def graph_support_problem(model: DeepseekForCausalLM, tbo: bool = False) -> str | None:
    """Why the model's decode forward (its two-batch overlap with ``tbo``) cannot be
    captured, or None when it can."""
    for moe in model.moe_layers():
        if not moe.dispatcher.capturable:
            return f"dispatcher {type(moe.dispatcher).__name__} (collectives sized on the host)"
    if tbo and model.decode_backend.plans_on_host:
        return f"two-batch overlap with {model.decode_backend.name} (one host plan per batch)"
    return None


class CudaGraphRunner(DecodeGraphRunner):
    """The model's decode forward over fixed buffers, replayed as CUDA graphs per bucket.

    ``run`` takes one step's rows (token id, position, the request's pages) and returns
    float32 logits [n, vocab]; the tensor is a view of graph memory, valid until the next
    ``run``. Kernels and attention backends are the model's own (``model.set_kernels``);
    after switching them, call :meth:`reset`. ``tbo``: capture the two-batch overlap forward
    (module docstring).
    """

    def __init__(
        self,
        model: DeepseekForCausalLM,
        kv_pool: MLAKVPool,
        max_batch: int,
        max_tokens_per_request: int,
        use_graphs: bool = True,
        min_page_bucket: int = 1,
        tbo: bool = False,
    ) -> None:
        problem = graph_support_problem(model, tbo)
        if problem is not None:
            raise ValueError(f"CUDA graphs do not support {problem}")
        page_size = kv_pool.page_size
        max_pages = min(pages_for(max_tokens_per_request, page_size), kv_pool.num_pages)
        device = kv_pool.buffer.device
        super().__init__(
            DecodeInputs(device, max_batch, page_size, max_pages, min_page_bucket), use_graphs
        )
        self.model = model
        self.kv_pool = kv_pool
        self.tbo = tbo

    @property
    def decode_backend(self) -> MLADecodeBackend:
        return self.model.decode_backend

    @property
    def attention_backend(self) -> str:
        return self.model.decode_backend.name

    @property
    def moe_backend(self) -> str:
        return "fused" if self.model.kernels.fused_moe else "grouped"

    def run(
        self,
        token_ids: Sequence[int],
        positions: Sequence[int],
        pages: Sequence[Sequence[int] | np.ndarray],
        device_ids: torch.Tensor | None = None,
        min_rows: int = 1,
        min_pages: int = 1,
    ) -> torch.Tensor:
        """One decode step: row i feeds ``token_ids[i]`` at ``positions[i]`` of a request
        whose KV lives in ``pages[i]`` (in token order). Returns logits [n, vocab] float32.

        ``device_ids`` [n] (on the device) replaces ``token_ids``: the tokens a step still
        running on the GPU is producing (overlapped decode); the copy is ordered after it on
        the stream, and nothing here waits for the GPU. ``min_rows`` / ``min_pages``: run at
        least that bucket (every rank of an expert-parallel group runs the group's largest)."""
        return self.run_with_hidden(token_ids, positions, pages, device_ids, min_rows, min_pages)[0]

    def run_with_hidden(
        self,
        token_ids: Sequence[int],
        positions: Sequence[int],
        pages: Sequence[Sequence[int] | np.ndarray],
        device_ids: torch.Tensor | None = None,
        min_rows: int = 1,
        min_pages: int = 1,
    ) -> Outputs:
        """:meth:`run`, returning (logits [n, vocab] float32, the final hidden states [n,
        hidden] the LM head read: what the MTP draft is fed); both views of graph memory."""
        n = len(token_ids)
        b, p, table, seq_lens = self.inputs.load(token_ids, positions, pages, min_rows, min_pages)
        self.model.decode_backend.prepare_replay(table, seq_lens)
        if device_ids is not None:
            self.inputs.load_ids(n, b, device_ids)
        logits, hidden = self._replay((b, p))
        return logits[:n], hidden[:n]

    def warm_up(self, max_tokens: int, ready_batches: int = 0) -> int:
        """Capture the (batch, page) buckets of contexts up to ``max_tokens`` now rather than
        on first use (a capture stalls the running batch): those of the ``ready_batches``
        smallest batch buckets (0: all), and queue the others in :attr:`deferred` for
        :meth:`capture_deferred` (dsmesh/engine/runner/graph_schedule.py). Call it before any
        request exists: it writes KV into the pool's first pages. Returns the graphs
        captured."""
        if not self.use_graphs or max_tokens <= 0:
            return 0
        before = len(self.graphs)
        now, later = capture_plan(self.buckets, self._page_buckets(max_tokens), ready_batches)
        for b, p in now:
            self.run([0] * b, [p * self.page_size - 1] * b, [range(p)] * b)
        torch.cuda.synchronize(self.device)
        self.keys_used.clear()
        self.deferred = DeferredCaptures([k for k in later if k not in self.graphs])
        return len(self.graphs) - before

    def capture_deferred(self, key: Key, scratch_page: int) -> None:
        """Capture ``key``, a graph :attr:`deferred` queued (``deferred.next`` says which is
        due), its rows writing their KV into ``scratch_page`` only (a page no request
        holds). Raises GraphCaptureError."""
        assert self.deferred is not None
        b, p = key
        table, seq_lens = self.inputs.load(
            [0] * b, [p * self.page_size - 1] * b, [[scratch_page] * p] * b
        )[2:]
        self.model.decode_backend.prepare_replay(table, seq_lens)
        self._capture(key)
        self.deferred.captured(key)

    def forward(self, b: int, p: int) -> torch.Tensor:
        """``model.forward`` over the first ``b`` rows of the buffers -> logits [b, vocab]."""
        return self._forward((b, p))[0]

    def _forward(self, key: tuple[int, ...]) -> Outputs:
        b, p = key
        tbo = self.tbo and b > 1  # split at b // 2 (ForwardBatch.split_rows)
        with self.model.static_dispatch():
            hidden = self.model.hidden_states(self.inputs.batch(b, p), self.kv_pool, tbo=tbo)
            return self.model.compute_logits(hidden), hidden
