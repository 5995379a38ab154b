"""Prefix cache host cost: insert and lookup of one long prompt (dsmesh/engine/kv/prefix_cache.py).

    python -m dsmesh.bench.prefix_cache [--tokens 32768 131072] [--page-sizes 1 16] [--repeats 7]

For each prompt length and page size, on an empty cache: ``insert`` of a finished request's
whole prompt (every page new), then ``match`` of the same prompt (a full hit, as a resent
prompt sees) and of a prompt that differs after its first page (a miss after one page). Both
lookups include converting the prompt list to a tuple, as the engine's lookups do. Times are
in milliseconds over ``--repeats`` fresh caches: the median, and the best in brackets (the
figure least disturbed by other work on a shared machine). Python's garbage collector runs as
usual. The target (docs/BENCHMARKS.md) is a 128K-token hit at page size 16 under 5 ms.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import dataclass

from dsmesh.engine.kv.pool import PageAllocator, pages_for
from dsmesh.engine.kv.prefix_cache import PrefixCache


@dataclass(frozen=True)
class Timing:
    num_tokens: int
    page_size: int
    num_pages: int
    insert_ms: tuple[float, float]  # (median, best)
    hit_ms: tuple[float, float]
    miss_ms: tuple[float, float]


def summary(seconds: list[float]) -> tuple[float, float]:
    return statistics.median(seconds) * 1e3, min(seconds) * 1e3


def cell(ms: tuple[float, float]) -> str:
    return f"{ms[0]:.2f} ({ms[1]:.2f})"


def measure(num_tokens: int, page_size: int, repeats: int, seed: int = 0) -> Timing:
    rng = random.Random(seed)
    prompt = [rng.randrange(100_000) for _ in range(num_tokens)]
    other = prompt[:page_size] + [t + 1 for t in prompt[page_size:]]
    num_pages = pages_for(num_tokens, page_size)
    inserts, hits, misses = [], [], []
    for _ in range(repeats):
        alloc = PageAllocator(num_pages)
        cache = PrefixCache(alloc, page_size)
        pages = alloc.allocate(num_pages)
        start = time.perf_counter()
        to_free = cache.insert(prompt, pages, num_matched=0)
        inserts.append(time.perf_counter() - start)
        alloc.free(to_free)

        start = time.perf_counter()
        matched = cache.match(prompt)
        hits.append(time.perf_counter() - start)
        assert len(matched) == (num_tokens - 1) // page_size
        cache.release(matched)

        start = time.perf_counter()
        matched = cache.match(other)
        misses.append(time.perf_counter() - start)
        assert len(matched) == min(1, (num_tokens - 1) // page_size)
        cache.release(matched)
    return Timing(
        num_tokens,
        page_size,
        num_pages,
        insert_ms=summary(inserts),
        hit_ms=summary(hits),
        miss_ms=summary(misses),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[32768, 131072])
    ap.add_argument("--page-sizes", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    print(
        f"{'tokens':>8} {'page':>5} {'pages':>7} {'insert ms':>17} {'hit ms':>15} {'miss ms':>15}"
    )
    for num_tokens in args.tokens:
        for page_size in args.page_sizes:
            t = measure(num_tokens, page_size, args.repeats)
            print(
                f"{t.num_tokens:>8} {t.page_size:>5} {t.num_pages:>7} {cell(t.insert_ms):>17} "
                f"{cell(t.hit_ms):>15} {cell(t.miss_ms):>15}"
            )


if __name__ == "__main__":
    main()
