"""Decode steps as CUDA graphs of the model's own forward, one per (batch bucket, page bucket).

A decode step (every request feeds one token) does the same work at every step of the same
batch size, so it is captured once and replayed, which removes the launch gaps of thousands
of small kernels per step. The runner re-implements nothing: it keeps fixed input buffers
(``meta`` [4, max_batch] int64: token ids, positions, KV slots, lengths; one page table
[max_batch, pages] int32 per page bucket), builds a
:meth:`ForwardBatch.decode_only` over them and captures ``model.forward``, whose modules
never synchronise with the host on that path (engine/kernel_choice.py; MoE dispatch in its
static mode).

A batch of ``n`` requests runs in the smallest bucket ``b >= n``; the padding rows repeat row
0 exactly (token, position, slot, pages), so they rewrite row 0's KV and change nothing.
Before every run the decode backend gets the step's host page table
(``MLADecodeBackend.prepare_replay``: FlashInfer plans there). Graphs are captured when a
bucket is first needed (or by :meth:`CudaGraphRunner.warm_up`), with that step's inputs in
the buffers. Without CUDA, or with ``use_graphs=False``, the same forward runs uncaptured,
which is how CPU tests check it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import torch

from engine.forward_batch import ForwardBatch
from engine.graph_buckets import batch_buckets, bucket_for, page_bucket
from engine.kv_cache import MLAKVPool, pages_for
from engine.model import DeepseekForCausalLM

log = logging.getLogger(__name__)

# Rows of the ``meta`` buffer.
_IDS, _POS, _SLOT, _LEN = range(4)


class GraphCaptureError(RuntimeError):
    """A decode step could not be captured; the caller may run it (and later ones) eagerly."""


def graph_support_problem(model: DeepseekForCausalLM) -> str | None:
    """Why the model's decode forward cannot be captured, or None when it can."""
    for moe in model.moe_layers():
        if not moe.dispatcher.capturable:
            return f"dispatcher {type(moe.dispatcher).__name__} (collectives sized on the host)"
    return None


class CudaGraphRunner:
    """The model's decode forward over fixed buffers, replayed as CUDA graphs per bucket.

    ``run`` takes one step's rows (token id, position, the request's pages) and returns
    float32 logits [n, vocab]; the tensor is a view of graph memory, valid until the next
    ``run``. Kernels and attention backends are the model's own (``model.set_kernels``);
    after switching them, call :meth:`reset`.
    """

    def __init__(
        self,
        model: DeepseekForCausalLM,
        kv_pool: MLAKVPool,
        max_batch: int,
        max_tokens_per_request: int,
        use_graphs: bool = True,
        min_page_bucket: int = 1,
    ) -> None:
        problem = graph_support_problem(model)
        if problem is not None:
            raise ValueError(f"CUDA graphs do not support {problem}")
        self.model = model
        self.kv_pool = kv_pool
        self.device = kv_pool.buffer.device
        self.buckets = batch_buckets(max_batch)
        self.max_batch = max_batch
        self.page_size = kv_pool.page_size
        self.max_pages = min(pages_for(max_tokens_per_request, self.page_size), kv_pool.num_pages)
        # Short contexts share the smallest page table, so few buckets cover common contexts
        self.min_page_bucket = min(max(1, min_page_bucket), self.max_pages)
        self.use_graphs = use_graphs and self.device.type == "cuda"
        self.meta = torch.zeros(4, max_batch, dtype=torch.int64, device=self.device)
        self.tables: dict[int, torch.Tensor] = {}
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        self.num_replays = 0
        self.num_eager = 0
        self.keys_used: set[tuple[int, int]] = set()  # (batch bucket, page bucket) run so far

    @property
    def attention_backend(self) -> str:
        return self.model.decode_backend.name

    @property
    def moe_backend(self) -> str:
        return "fused" if self.model.kernels.fused_moe else "grouped"

    def reset(self) -> None:
        """Drop every captured graph (after ``model.set_kernels`` switched kernels)."""
        self.graphs.clear()
        if self.use_graphs:  # a fresh pool: capturing into one whose graphs died can fail
            self.pool = torch.cuda.graph_pool_handle()

    def can_run(self, num_rows: int) -> bool:
        return 0 < num_rows <= self.max_batch

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
        n = len(token_ids)
        if not (n == len(positions) == len(pages)) or not self.can_run(max(n, min_rows)):
            raise ValueError(f"bad decode step: {n} rows (max {self.max_batch})")
        b = bucket_for(max(n, min_rows), self.buckets)
        need = max(pages_for(max(positions) + 1, self.page_size), min_pages)
        p = page_bucket(need, self.max_pages, self.min_page_bucket)
        table, seq_lens = self._load_inputs(b, p, token_ids, positions, pages)
        self.model.decode_backend.prepare_replay(table, seq_lens)
        if device_ids is not None:
            if device_ids.shape != (n,):
                raise ValueError(f"device_ids must be [{n}], got {tuple(device_ids.shape)}")
            self.meta[_IDS, :n].copy_(device_ids)
            self.meta[_IDS, n:b].copy_(device_ids[:1].expand(b - n))
        self.keys_used.add((b, p))
        if not self.use_graphs:
            self.num_eager += 1
            return self.forward(b, p)[:n]
        if (b, p) not in self.graphs:
            self._capture(b, p)
        graph, logits = self.graphs[(b, p)]
        graph.replay()
        self.num_replays += 1
        return logits[:n]

    def warm_up(self, max_tokens: int) -> int:
        """Capture every (batch, page) bucket up to ``max_tokens`` of context now rather than
        on first use (a capture stalls the running batch). Call it before any request
        exists: it writes KV into the pool's first pages. Returns the graphs captured."""
        if not self.use_graphs or max_tokens <= 0:
            return 0
        ps = self.page_size
        top = page_bucket(
            min(pages_for(max_tokens, ps), self.max_pages), self.max_pages, self.min_page_bucket
        )
        before = len(self.graphs)
        p = page_bucket(1, self.max_pages, self.min_page_bucket)
        while True:
            for b in self.buckets:
                self.run([0] * b, [p * ps - 1] * b, [range(p)] * b)
            if p >= top:
                break
            p = page_bucket(p + 1, self.max_pages, self.min_page_bucket)
        torch.cuda.synchronize(self.device)
        self.keys_used.clear()
        return len(self.graphs) - before

    def forward(self, b: int, p: int) -> torch.Tensor:
        """``model.forward`` over the first ``b`` rows of the buffers -> logits [b, vocab]."""
        meta = self.meta[:, :b]
        batch = ForwardBatch.decode_only(
            meta[_IDS], meta[_POS], meta[_SLOT], self._table(p)[:b], meta[_LEN].to(torch.int32)
        )
        with self.model.static_dispatch():
            return self.model(batch, self.kv_pool)

    def _table(self, pages: int) -> torch.Tensor:
        if pages not in self.tables:
            self.tables[pages] = torch.zeros(
                self.max_batch, pages, dtype=torch.int32, device=self.device
            )
        return self.tables[pages]

    def _load_inputs(
        self,
        b: int,
        p: int,
        token_ids: Sequence[int],
        positions: Sequence[int],
        pages: Sequence[Sequence[int] | np.ndarray],
    ) -> tuple[np.ndarray, np.ndarray]:
        """Fill the buffers of bucket (b, p): vectorised, one host->device copy per buffer.
        Returns the host page table [b, p] and sequence lengths [b] just uploaded."""
        n = len(token_ids)
        ps = self.page_size
        table = np.zeros((b, p), dtype=np.int32)
        held = np.empty(n, dtype=np.int64)
        for i, req_pages in enumerate(pages):
            k = min(len(req_pages), p)
            table[i, :k] = req_pages[:k]
            held[i] = len(req_pages)
        pos = np.asarray(positions, dtype=np.int64)
        short = np.nonzero((pos // ps + 1) > held)[0]
        if short.size:
            i = int(short[0])
            raise ValueError(f"row {i}: {held[i]} pages cannot hold position {pos[i]}")
        table[n:] = table[0]  # padding rows repeat row 0 exactly
        meta = np.empty((4, b), dtype=np.int64)
        meta[_IDS, :n] = token_ids
        meta[_POS, :n] = pos
        meta[_SLOT, :n] = table[np.arange(n), pos // ps].astype(np.int64) * ps + pos % ps
        meta[:, n:] = meta[:, :1]
        meta[_LEN] = meta[_POS] + 1
        self._upload(self.meta[:, :b], meta)
        self._upload(self._table(p)[:b], table)
        return table, meta[_LEN].astype(np.int32)

    def _upload(self, dst: torch.Tensor, src: np.ndarray) -> None:
        """Host -> device from pinned memory, ordered on the stream (no wait for the GPU)."""
        host = torch.from_numpy(src)
        if dst.is_cuda:
            dst.copy_(host.pin_memory(), non_blocking=True)
        else:
            dst.copy_(host)

    def _capture(self, b: int, p: int) -> None:
        try:
            self.model.decode_backend.prepare_capture(b)
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(2):  # JIT compiles, cuBLAS handles, cached probes
                    self.forward(b, p)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                logits = self.forward(b, p)
        except Exception as exc:
            raise GraphCaptureError(f"capturing decode graph ({b}, {p}) failed: {exc}") from exc
        self.graphs[(b, p)] = (graph, logits)
        log.info("captured decode graph batch=%d pages=%d", b, p)
