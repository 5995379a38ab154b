"""Fixed input buffers and per-bucket CUDA graphs of decode-shaped forwards.

A decode-shaped forward feeds one token per row, each row with its own position and page
table row: a request's decode step, or a speculative step's verify rows (a request's last
token and its drafts, one row per position). Its runners capture their module's own forward
over the buffers of a :class:`DecodeInputs` once per bucket and replay it:
:class:`dsmesh.engine.runner.cuda_graph.CudaGraphRunner` for the model and
:class:`dsmesh.engine.speculative.mtp_graph.MTPGraphRunner` for the MTP draft, which reads the same
buffers as the model's runner, so a speculative step's first draft runs over its verify rows as
loaded.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Sequence

import numpy as np
import torch

from dsmesh.engine.model.forward_batch import ForwardBatch
from dsmesh.engine.model.mla_decode_backend import MLADecodeBackend
from dsmesh.engine.runner.graph_buckets import batch_buckets, bucket_for, page_bucket
from dsmesh.engine.runner.graph_schedule import DeferredCaptures

log = logging.getLogger(__name__)

# Rows of the ``meta`` buffer.
_IDS, _POS, _SLOT, _LEN = range(4)

Outputs = tuple[torch.Tensor, torch.Tensor]


class GraphCaptureError(RuntimeError):
    """A decode step could not be captured; the caller may run it (and later ones) eagerly."""


class DecodeInputs:
    """The buffers captured decode forwards read: ``meta`` [4, max_rows] int64 (token ids,
    positions, KV slots, context lengths) and one page table [max_rows, p] int32 per page
    bucket ``p``. A batch of ``n`` rows runs in the smallest bucket ``b >= n``; its padding
    rows repeat row 0 exactly (token, position, slot, pages), so they rewrite row 0's KV and
    change nothing. Every write is ordered on the current stream (no wait for the GPU)."""

    def __init__(
        self,
        device: torch.device,
        max_rows: int,
        page_size: int,
        max_pages: int,
        min_page_bucket: int = 1,
    ) -> None:
        self.device = device
        self.buckets = batch_buckets(max_rows)
        self.max_rows = max_rows
        self.page_size = page_size
        self.max_pages = max_pages
        # Short contexts share the smallest page table, so few buckets cover common contexts
        self.min_page_bucket = min(max(1, min_page_bucket), max_pages)
        self.meta = torch.zeros(4, max_rows, dtype=torch.int64, device=device)
        self.tables: dict[int, torch.Tensor] = {}
        # (rows, batch bucket, page bucket) of the last :meth:`load`
        self.loaded: tuple[int, int, int] | None = None

    def can_run(self, num_rows: int) -> bool:
        return 0 < num_rows <= self.max_rows

    def page_bucket(self, num_tokens: int, min_pages: int = 1) -> int:
        """The page bucket of rows whose contexts hold up to ``num_tokens`` tokens."""
        need = max(-(-num_tokens // self.page_size), min_pages)
        return page_bucket(need, self.max_pages, self.min_page_bucket)

    def table(self, pages: int) -> torch.Tensor:
        if pages not in self.tables:
            self.tables[pages] = torch.zeros(
                self.max_rows, pages, dtype=torch.int32, device=self.device
            )
        return self.tables[pages]

    def token_ids(self, n: int) -> torch.Tensor:
        """The token ids [n] int64 the rows were last fed (a view of the buffer)."""
        return self.meta[_IDS, :n]

    def batch(self, b: int, p: int) -> ForwardBatch:
        """A decode-only batch over the first ``b`` rows and page table ``p``."""
        meta = self.meta[:, :b]
        return ForwardBatch.decode_only(
            meta[_IDS], meta[_POS], meta[_SLOT], self.table(p)[:b], meta[_LEN].to(torch.int32)
        )

    def load(
        self,
        token_ids: Sequence[int],
        positions: Sequence[int],
        pages: Sequence[Sequence[int] | np.ndarray],
        min_rows: int = 1,
        min_pages: int = 1,
    ) -> tuple[int, int, np.ndarray, np.ndarray]:
        """Row i feeds ``token_ids[i]`` at ``positions[i]`` of a request whose KV lives in
        ``pages[i]`` (in token order), in bucket (b, p), at least (``min_rows``,
        ``min_pages``): vectorised, one host->device copy per buffer. Returns (b, p, the host
        page table [b, p] and sequence lengths [b] just uploaded)."""
        n = len(token_ids)
        if not (n == len(positions) == len(pages)) or not self.can_run(max(n, min_rows)):
            raise ValueError(f"bad decode step: {n} rows (max {self.max_rows})")
        b = bucket_for(max(n, min_rows), self.buckets)
        p = self.page_bucket(max(positions) + 1, min_pages)
        ps = self.page_size
        table = np.zeros((b, p), dtype=np.int32)
        self._fill_table(table, pages)
        pos = np.asarray(positions, dtype=np.int64)
        held = np.fromiter((len(r) for r in pages), dtype=np.int64, count=n)
        short = np.nonzero((pos // ps + 1) > held)[0]
        if short.size:
            i = int(short[0])
            raise ValueError(f"row {i}: {held[i]} pages cannot hold position {pos[i]}")
        meta = np.empty((4, b), dtype=np.int64)
        meta[_IDS, :n] = token_ids
        meta[_POS, :n] = pos
        meta[_SLOT, :n] = table[np.arange(n), pos // ps].astype(np.int64) * ps + pos % ps
        meta[:, n:] = meta[:, :1]
        meta[_LEN] = meta[_POS] + 1
        self._upload(self.meta[:, :b], meta)
        self._upload(self.table(p)[:b], table)
        self.loaded = (n, b, p)
        return b, p, table, meta[_LEN].astype(np.int32)

    def load_pages(self, p: int, pages: Sequence[Sequence[int] | np.ndarray], b: int) -> None:
        """Only the page table rows of bucket (b, p): row i = ``pages[i]``, for rows whose
        positions :meth:`place` computes on the device."""
        table = np.zeros((b, p), dtype=np.int32)
        self._fill_table(table, pages)
        self._upload(self.table(p)[:b], table)

    def load_ids(self, n: int, b: int, ids: torch.Tensor) -> None:
        """Token ids [n] on the device for rows 0..n-1 (padding rows: row 0's); the copy is
        ordered after the step producing them on the stream."""
        if ids.shape != (n,):
            raise ValueError(f"device ids must be [{n}], got {tuple(ids.shape)}")
        self.meta[_IDS, :n].copy_(ids)
        self.meta[_IDS, n:b].copy_(ids[:1].expand(b - n))

    def place(self, b: int, p: int, positions: torch.Tensor) -> None:
        """Rows 0..n-1 at ``positions`` [n] int64 (on the device) of the pages in table
        ``p`` (:meth:`load_pages`): their KV slots and lengths computed on the device, the
        padding rows up to ``b`` repeating row 0. The positions must lie in those pages."""
        n = positions.shape[0]
        ps = self.page_size
        meta = self.meta
        page = self.table(p)[:n].gather(1, (positions // ps).unsqueeze(1)).squeeze(1)
        meta[_POS, :n].copy_(positions)
        meta[_SLOT, :n].copy_(page.to(torch.int64) * ps + positions % ps)
        meta[_LEN, :n].copy_(positions + 1)
        meta[_POS:, n:b].copy_(meta[_POS:, :1].expand(-1, b - n))

    def _fill_table(self, table: np.ndarray, pages: Sequence[Sequence[int] | np.ndarray]) -> None:
        p = table.shape[1]
        for i, req_pages in enumerate(pages):
            k = min(len(req_pages), p)
            table[i, :k] = req_pages[:k]
        table[len(pages) :] = table[0]  # padding rows repeat row 0 exactly

    def _upload(self, dst: torch.Tensor, src: np.ndarray) -> None:
        """Host -> device from pinned memory, ordered on the stream (no wait for the GPU)."""
        host = torch.from_numpy(src)
        if dst.is_cuda:
            dst.copy_(host.pin_memory(), non_blocking=True)
        else:
            dst.copy_(host)


class DecodeGraphRunner(ABC):
    """A module's forward over :class:`DecodeInputs`, replayed as a CUDA graph per key (its
    first item the batch bucket). Graphs are captured when a key is first needed, with that
    step's inputs in the buffers, into this runner's own memory pool; outputs are views of
    graph memory, valid until this runner's next replay. Without CUDA, or with
    ``use_graphs=False``, the same forward runs uncaptured, which is how CPU tests check it.
    """

    def __init__(self, inputs: DecodeInputs, use_graphs: bool) -> None:
        self.inputs = inputs
        self.device = inputs.device
        self.use_graphs = use_graphs and self.device.type == "cuda"
        self.graphs: dict[tuple[int, ...], tuple[torch.cuda.CUDAGraph, Outputs]] = {}
        self.pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        self.num_replays = 0
        self.num_eager = 0
        self.keys_used: set[tuple[int, int]] = set()  # (batch bucket, page bucket) run so far
        # graphs queued for after ready (dsmesh/engine/runner/graph_schedule.py); their
        # steps run uncaptured until captured
        self.deferred: DeferredCaptures | None = None

    @property
    @abstractmethod
    def decode_backend(self) -> MLADecodeBackend: ...

    @abstractmethod
    def _forward(self, key: tuple[int, ...]) -> Outputs:
        """The module's forward over the buffers of ``key`` (two output tensors)."""

    @property
    def buckets(self) -> list[int]:
        return self.inputs.buckets

    @property
    def max_batch(self) -> int:
        return self.inputs.max_rows

    @property
    def page_size(self) -> int:
        return self.inputs.page_size

    @property
    def min_page_bucket(self) -> int:
        return self.inputs.min_page_bucket

    def can_run(self, num_rows: int) -> bool:
        return self.inputs.can_run(num_rows)

    def reset(self) -> None:
        """Drop every captured graph (after the module's kernels were switched)."""
        self.graphs.clear()
        self.deferred = None  # every graph is captured on first use again
        if self.use_graphs:  # a fresh pool: capturing into one whose graphs died can fail
            self.pool = torch.cuda.graph_pool_handle()

    def _replay(self, key: tuple[int, ...]) -> Outputs:
        self.keys_used.add((key[0], key[1]))
        if not self.use_graphs:
            self.num_eager += 1
            return self._forward(key)
        if self.deferred is not None and self.deferred.runs_uncaptured(key):
            self.num_eager += 1
            self.decode_backend.prepare_capture(key[0])  # as before a capture's warm-up runs
            return self._forward(key)
        if key not in self.graphs:
            self._capture(key)
        graph, outputs = self.graphs[key]
        graph.replay()
        self.num_replays += 1
        return outputs

    def _capture(self, key: tuple[int, ...]) -> None:
        try:
            self.decode_backend.prepare_capture(key[0])
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(2):  # JIT compiles, cuBLAS handles, cached probes
                    self._forward(key)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                outputs = self._forward(key)
        except Exception as exc:
            name = type(self).__name__
            raise GraphCaptureError(f"{name}: capturing graph {key} failed: {exc}") from exc
        self.graphs[key] = (graph, outputs)
        log.info("%s captured graph %s", type(self).__name__, key)

    def _page_buckets(self, max_tokens: int) -> list[int]:
        """Page buckets of contexts up to ``max_tokens`` tokens, smallest first."""
        top = self.inputs.page_bucket(min(max_tokens, self.inputs.max_pages * self.page_size))
        out = [self.inputs.page_bucket(1)]
        while out[-1] < top:
            out.append(page_bucket(out[-1] + 1, self.inputs.max_pages, self.min_page_bucket))
        return out
