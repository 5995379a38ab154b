"""Paged MLA latent cache: one pool per process, pages handed out in runs by an allocator.

A page holds ``page_size`` consecutive tokens of one request, for every layer. Token ``i`` of a
request lives in page ``page_table[i // page_size]`` at offset ``i % page_size``; its flat slot
is ``page * page_size + offset``. Each slot stores the normalised KV latent
(``kv_lora_rank`` values) followed by the rotated shared rope key (``qk_rope_head_dim``).

The values are in the model's dtype, or in FP8 (``--kv-cache-dtype fp8_e4m3``) with two
float32 scales per token kept inside each page after its values
(:mod:`dsmesh.kernels.kv_fp8`), so a page-granular copy (the PD handoff, a prefix-cache
page) moves the scales with the values.
"""

from __future__ import annotations

import heapq

import numpy as np
import torch

from dsmesh.kernels.kv_fp8 import (
    KV_FP8_DTYPE,
    KV_SCALES_PER_TOKEN,
    dequantize_kv_fp8,
    quantize_kv_fp8,
)

# EngineConfig.kv_cache_dtype: "auto" = the model's dtype, "fp8_e4m3" = the FP8 page format
KV_CACHE_DTYPES = ("auto", "fp8_e4m3")


class OutOfPagesError(RuntimeError):
    """Not enough free KV pages; the caller may wait, retry later or reject the request."""


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype the pool stores values in for ``EngineConfig.kv_cache_dtype`` ``name``."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {name!r}")
    return model_dtype if name == "auto" else KV_FP8_DTYPE


def kv_bytes_per_token(kv_dim: int, dtype: torch.dtype) -> int:
    """Bytes of one token in one layer of a pool of ``dtype``: its ``kv_dim`` values, and in
    FP8 its two float32 scales (576-wide latents: 1152 bytes in bf16, 584 in FP8)."""
    scales = KV_SCALES_PER_TOKEN * 4 if dtype == KV_FP8_DTYPE else 0
    return kv_dim * dtype.itemsize + scales


def pages_for(num_tokens: int, page_size: int) -> int:
    """Pages needed to hold ``num_tokens`` tokens."""
    return -(-num_tokens // page_size)


class PageAllocator:
    """The free pages of ``[0, num_pages)``. Not thread-safe: one owner per pool.

    Pages of one allocation come out as few runs of consecutive ids as the free space
    allows, ascending: the smallest free run that holds them all (the lowest of equal ones),
    else the longest runs first. The KV transfer moves a run as one segment per layer
    instead of one per page (1701 segments cost 12 ms where 27 cost 0.3 ms for a 1000-token
    V2-Lite request over CUDA IPC, docs/BENCHMARKS.md), and a request's prompt pages are one
    allocation on both sides of the handoff. A single page (a request growing by one page
    as it decodes) is the lowest free one: a heap, no scan.
    """

    def __init__(self, num_pages: int) -> None:
        if num_pages <= 0:
            raise ValueError(f"num_pages must be > 0, got {num_pages}")
        self.num_pages = num_pages
        self._free = np.ones(num_pages, dtype=np.bool_)
        self._num_free = num_pages
        # lowest-first candidates for single pages; may hold pages taken since (skipped)
        self._heap: list[int] = list(range(num_pages))

    @property
    def num_free_pages(self) -> int:
        return self._num_free

    @property
    def num_used_pages(self) -> int:
        return self.num_pages - self._num_free

    def can_allocate(self, num: int) -> bool:
        return 0 <= num <= self._num_free

    def allocate(self, num: int) -> list[int]:
        """Take ``num`` pages; raises :class:`OutOfPagesError` and takes none if short."""
        if num < 0:
            raise ValueError(f"cannot allocate a negative number of pages ({num})")
        if num > self._num_free:
            raise OutOfPagesError(
                f"need {num} KV pages but only {self._num_free} of {self.num_pages} are free"
            )
        pages = [self._pop_lowest()] if num == 1 else self._runs_for(num).tolist()
        self._free[pages] = False
        self._num_free -= num
        return pages

    def has_run(self, num: int) -> bool:
        """Whether ``num`` consecutive pages are free."""
        if num <= 1:
            return num <= self._num_free
        return bool((self._free_runs()[1] >= num).any())

    def free(self, pages: list[int]) -> None:
        """Return pages. Freeing a page that is not allocated is a bug and raises ValueError."""
        if len(set(pages)) != len(pages):
            raise ValueError(f"duplicate page ids in free({pages})")
        for p in pages:
            if not (0 <= p < self.num_pages) or self._free[p]:
                raise ValueError(f"page {p} is not allocated (double free or foreign page)")
        self._free[pages] = True
        self._num_free += len(pages)
        if len(self._heap) + len(pages) > 2 * self.num_pages:  # mostly stale: rebuild
            self._heap = np.flatnonzero(self._free).tolist()  # ascending: a valid heap
        else:
            for p in pages:
                heapq.heappush(self._heap, p)

    def _pop_lowest(self) -> int:
        heap, free = self._heap, self._free
        while True:
            page = heapq.heappop(heap)
            if free[page]:
                return page

    def _free_runs(self) -> tuple[np.ndarray, np.ndarray]:
        """(first page, length) of every run of free pages, in page order."""
        edges = np.diff(self._free.view(np.int8), prepend=0, append=0)
        starts = np.flatnonzero(edges == 1)
        return starts, np.flatnonzero(edges == -1) - starts

    def _runs_for(self, num: int) -> np.ndarray:
        """``num`` free page ids, ascending, in as few runs as the free space allows."""
        starts, lengths = self._free_runs()
        fits = np.flatnonzero(lengths >= num)
        if fits.size:
            i = fits[np.argmin(lengths[fits])]  # the first of the smallest: the lowest
            return np.arange(starts[i], starts[i] + num)
        chosen = []
        for i in np.argsort(-lengths, kind="stable"):
            take = min(int(lengths[i]), num)
            chosen.append(np.arange(starts[i], starts[i] + take))
            num -= take
            if num == 0:
                break
        return np.sort(np.concatenate(chosen))


class MLAKVPool:
    """The KV tensor ``[layers, pages, page_size, kv_lora_rank + qk_rope_head_dim]``.

    Owns the memory only; which request owns which page is the allocator's and the
    scheduler's business. ``buffer`` is allocated once and never reallocated, so its address
    can be registered with a transfer engine.

    ``dtype`` float8_e4m3fn (``kv_lora_rank`` then required) stores the FP8 page format:
    ``buffer`` is uint8 ``[layers, pages, page_bytes]``, each page its ``page_size x kv_dim``
    e4m3 values then ``page_size x 2`` float32 scales (latent's, rope key's); ``kv``
    [layers, pages, page_size, kv_dim] float8_e4m3fn and ``scales`` [layers, pages,
    page_size, 2] float32 are strided views of it. Otherwise ``kv`` is ``buffer`` and
    ``scales`` None. Writes quantise per token, reads dequantise (to float32).
    """

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        kv_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        kv_lora_rank: int | None = None,
    ) -> None:
        if page_size <= 0:
            raise ValueError(f"page_size must be > 0, got {page_size}")
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.page_size = page_size
        self.kv_dim = kv_dim
        self.dtype = dtype  # of the values: the model's, or float8_e4m3fn
        self.fp8 = dtype == KV_FP8_DTYPE
        self.kv_lora_rank = kv_lora_rank
        self.allocator = PageAllocator(num_pages)
        if self.fp8:
            self._init_fp8(device)
            return
        self.buffer = torch.zeros(
            (num_layers, num_pages, page_size, kv_dim), dtype=dtype, device=device
        )
        self.kv = self.buffer
        self.scales: torch.Tensor | None = None
        self._flat = self.buffer.view(num_layers, num_pages * page_size, kv_dim)
        # one view per layer, made once: indexing _flat per call would dispatch a select op
        self._layers = self._flat.unbind(0)
        self._pages = self.buffer.unbind(0)

    def _init_fp8(self, device: torch.device | str) -> None:
        rank = self.kv_lora_rank
        if rank is None or not 0 < rank < self.kv_dim:
            raise ValueError(f"an FP8 pool needs kv_lora_rank in (0, {self.kv_dim}), got {rank}")
        shape = (self.num_layers, self.num_pages)
        ps, values = self.page_size, self.page_size * self.kv_dim
        self.buffer = torch.zeros(
            (*shape, kv_bytes_per_token(self.kv_dim, KV_FP8_DTYPE) * ps),
            dtype=torch.uint8,
            device=device,
        )
        if values % 4:  # the float32 scales must start 4-byte aligned
            raise ValueError(f"page_size * kv_dim must be a multiple of 4, got {values}")
        self._bytes = self.buffer[..., :values].view(*shape, ps, self.kv_dim)  # the e4m3 codes
        self.kv = self._bytes.view(KV_FP8_DTYPE)
        self.scales = self.buffer[..., values:].view(torch.float32).view(*shape, ps, 2)
        self._pages = self.kv.unbind(0)
        self._scale_pages = self.scales.unbind(0)
        self._byte_pages = self._bytes.unbind(0)

    @property
    def page_bytes(self) -> int:
        """Bytes of one page of one layer (the unit a KV transfer moves)."""
        return self.page_size * kv_bytes_per_token(self.kv_dim, self.dtype)

    def layer_slots(self, layer: int) -> torch.Tensor:
        """The ``layer``'s cache as [num_pages * page_size, kv_dim] (a view, writable; not
        for FP8 pools, whose pages also hold scales: :meth:`layer_pages`)."""
        if self.fp8:
            raise ValueError("an FP8 pool has no flat slot view: use layer_pages")
        return self._layers[layer]

    def layer_pages(self, layer: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The ``layer``'s pages [num_pages, page_size, kv_dim] (values) and, for FP8, their
        scales [num_pages, page_size, 2] float32 (else None); views, made once."""
        return self._pages[layer], self._scale_pages[layer] if self.fp8 else None

    def write(self, layer: int, slots: torch.Tensor, kv: torch.Tensor) -> None:
        """Store ``kv`` [T, kv_dim] at flat ``slots`` [T] of ``layer`` (FP8: quantised per
        token, :func:`dsmesh.kernels.kv_fp8.quantize_kv_fp8`)."""
        if not self.fp8:
            self._layers[layer].index_copy_(0, slots, kv.to(self.buffer.dtype))
            return
        values, scales = quantize_kv_fp8(kv, self.kv_lora_rank)
        at = (slots // self.page_size, slots % self.page_size)
        self._byte_pages[layer].index_put_(at, values.view(torch.uint8))
        self._scale_pages[layer].index_put_(at, scales)

    def read(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """Gather [len(slots), kv_dim] from ``layer`` (FP8: dequantised, float32)."""
        if not self.fp8:
            return self._layers[layer].index_select(0, slots)
        at = (slots // self.page_size, slots % self.page_size)
        values = self._byte_pages[layer][at].view(KV_FP8_DTYPE)
        return dequantize_kv_fp8(values, self._scale_pages[layer][at], self.kv_lora_rank)


def slots_for(page_table: torch.Tensor, start: int, end: int, page_size: int) -> torch.Tensor:
    """Flat slots [end - start] (int64) of token positions ``[start, end)`` of a request.

    ``page_table`` [num_pages] int64 lists the request's pages in token order.
    """
    pos = torch.arange(start, end, device=page_table.device)
    return page_table[pos // page_size] * page_size + pos % page_size
