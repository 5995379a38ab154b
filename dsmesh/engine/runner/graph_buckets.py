"""Bucket sizes of captured decode graphs: batch rows and page-table widths (pure)."""

from __future__ import annotations

from collections.abc import Sequence


def batch_buckets(max_batch: int) -> list[int]:
    """Powers of two below ``max_batch``, then ``max_batch`` itself: 1, 2, 4, ..., max_batch."""
    if max_batch <= 0:
        raise ValueError(f"max_batch must be > 0, got {max_batch}")
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    out.append(max_batch)
    return out


def bucket_for(n: int, buckets: Sequence[int]) -> int:
    """Smallest bucket >= n; ValueError when n exceeds the largest."""
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


def page_bucket(num_pages: int, max_pages: int, min_pages: int = 1) -> int:
    """Next power of two >= ``num_pages`` and >= ``min_pages``, capped at ``max_pages``."""
    if num_pages > max_pages:
        raise ValueError(f"{num_pages} pages exceed the most a request can hold ({max_pages})")
    p = 1
    while p < max(num_pages, min_pages):
        p *= 2
    return min(p, max_pages)
