"""Paged MLA latent cache: one pool per process, pages handed out by a free-list allocator.

A page holds ``page_size`` consecutive tokens of one request, for every layer. Token ``i`` of a
request lives in page ``page_table[i // page_size]`` at offset ``i % page_size``; its flat slot
is ``page * page_size + offset``. Each slot stores the normalised KV latent
(``kv_lora_rank`` values) followed by the rotated shared rope key (``qk_rope_head_dim``).
"""

from __future__ import annotations

import torch


class OutOfPagesError(RuntimeError):
    """Not enough free KV pages; the caller may wait, retry later or reject the request."""


def pages_for(num_tokens: int, page_size: int) -> int:
    """Pages needed to hold ``num_tokens`` tokens."""
    return -(-num_tokens // page_size)


class PageAllocator:
    """Free list of page ids ``[0, num_pages)``. Not thread-safe: one owner per pool."""

    def __init__(self, num_pages: int) -> None:
        if num_pages <= 0:
            raise ValueError(f"num_pages must be > 0, got {num_pages}")
        self.num_pages = num_pages
        # Pop from the end so low page ids go out first (stable, easy to read in tests).
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._used = bytearray(num_pages)

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def num_used_pages(self) -> int:
        return self.num_pages - len(self._free)

    def can_allocate(self, num: int) -> bool:
        return 0 <= num <= len(self._free)

    def allocate(self, num: int) -> list[int]:
        """Take ``num`` pages; raises :class:`OutOfPagesError` and takes none if short."""
        if num < 0:
            raise ValueError(f"cannot allocate a negative number of pages ({num})")
        if num > len(self._free):
            raise OutOfPagesError(
                f"need {num} KV pages but only {len(self._free)} of {self.num_pages} are free"
            )
        pages = [self._free.pop() for _ in range(num)]
        for p in pages:
            self._used[p] = 1
        return pages

    def free(self, pages: list[int]) -> None:
        """Return pages. Freeing a page that is not allocated is a bug and raises ValueError.

        The pages go back so that the next allocation takes them in ascending order: a
        request's run of consecutive pages comes back as a run, so the KV transfer moves it
        as one segment per layer instead of one per page (1701 segments cost 12 ms where 27
        cost 0.3 ms for a 1000-token V2-Lite request over CUDA IPC, docs/BENCHMARKS.md)."""
        if len(set(pages)) != len(pages):
            raise ValueError(f"duplicate page ids in free({pages})")
        for p in pages:
            if not (0 <= p < self.num_pages) or not self._used[p]:
                raise ValueError(f"page {p} is not allocated (double free or foreign page)")
        for p in sorted(pages, reverse=True):
            self._used[p] = 0
            self._free.append(p)


class MLAKVPool:
    """The KV tensor ``[layers, pages, page_size, kv_lora_rank + qk_rope_head_dim]``.

    Owns the memory only; which request owns which page is the allocator's and the
    scheduler's business. ``buffer`` is allocated once and never reallocated, so its address
    can be registered with a transfer engine.
    """

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        kv_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        if page_size <= 0:
            raise ValueError(f"page_size must be > 0, got {page_size}")
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.page_size = page_size
        self.kv_dim = kv_dim
        self.buffer = torch.zeros(
            (num_layers, num_pages, page_size, kv_dim), dtype=dtype, device=device
        )
        self._flat = self.buffer.view(num_layers, num_pages * page_size, kv_dim)
        # one view per layer, made once: indexing _flat per call would dispatch a select op
        self._layers = self._flat.unbind(0)
        self.allocator = PageAllocator(num_pages)

    @property
    def page_bytes(self) -> int:
        """Bytes of one page of one layer (the unit a KV transfer moves)."""
        return self.page_size * self.kv_dim * self.buffer.element_size()

    def layer_slots(self, layer: int) -> torch.Tensor:
        """The ``layer``'s cache as [num_pages * page_size, kv_dim] (a view, writable)."""
        return self._layers[layer]

    def write(self, layer: int, slots: torch.Tensor, kv: torch.Tensor) -> None:
        """Store ``kv`` [T, kv_dim] at flat ``slots`` [T] of ``layer``."""
        self._layers[layer].index_copy_(0, slots, kv.to(self.buffer.dtype))

    def read(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """Gather [len(slots), kv_dim] from ``layer``."""
        return self._layers[layer].index_select(0, slots)


def slots_for(page_table: torch.Tensor, start: int, end: int, page_size: int) -> torch.Tensor:
    """Flat slots [end - start] (int64) of token positions ``[start, end)`` of a request.

    ``page_table`` [num_pages] int64 lists the request's pages in token order.
    """
    pos = torch.arange(start, end, device=page_table.device)
    return page_table[pos // page_size] * page_size + pos % page_size
