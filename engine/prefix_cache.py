"""Prefix cache of full prompt pages, shared between requests with a common prompt prefix.

A cached page is keyed by its whole prefix: (key of the previous page, tokens of this page),
so a hit is exact (no hash collisions) and only page-aligned prefixes are shared. Each cached
page has a reference count of the running requests using it; pages with no users stay cached
until the allocator needs them back (least recently used first).

Ownership: a page is owned either by exactly one request, or by the cache. ``insert`` moves a
finished request's full prompt pages into the cache; pages it did not insert (already
cached, or partial) the caller frees as usual.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from engine.kv_cache import PageAllocator

PageKey = tuple[object, tuple[int, ...]]


@dataclass
class _Entry:
    page: int
    refs: int


class PrefixCache:
    def __init__(self, allocator: PageAllocator, page_size: int) -> None:
        self.allocator = allocator
        self.page_size = page_size
        self._entries: dict[PageKey, _Entry] = {}
        self._by_page: dict[int, PageKey] = {}
        self._idle: OrderedDict[PageKey, None] = OrderedDict()  # refs == 0, LRU first

    @property
    def num_cached_pages(self) -> int:
        return len(self._entries)

    @property
    def num_evictable_pages(self) -> int:
        return len(self._idle)

    def _keys(self, token_ids: list[int], num_pages: int) -> list[PageKey]:
        keys: list[PageKey] = []
        parent: object = None
        for i in range(num_pages):
            key: PageKey = (parent, tuple(token_ids[i * self.page_size : (i + 1) * self.page_size]))
            keys.append(key)
            parent = key
        return keys

    def match(self, token_ids: list[int]) -> list[int]:
        """Pages of the longest cached page-aligned prefix, leaving >= 1 token to compute.

        Takes a reference on each returned page; give them back with :meth:`release`.
        """
        max_pages = (len(token_ids) - 1) // self.page_size
        pages: list[int] = []
        for key in self._keys(token_ids, max_pages):
            entry = self._entries.get(key)
            if entry is None:
                break
            if entry.refs == 0:
                self._idle.pop(key, None)
            entry.refs += 1
            pages.append(entry.page)
        return pages

    def release(self, pages: list[int]) -> None:
        """Drop one reference on each cached page (from :meth:`match`)."""
        for page in pages:
            key = self._by_page[page]
            entry = self._entries[key]
            entry.refs -= 1
            if entry.refs == 0:
                self._idle[key] = None

    def insert(self, token_ids: list[int], pages: list[int], num_matched: int) -> list[int]:
        """Offer a finished request's pages; returns the pages the caller must still free.

        ``pages[:num_matched]`` came from :meth:`match` (their references are dropped here);
        the request's later full prompt pages become cached if that prefix is not cached yet.
        """
        self.release(pages[:num_matched])
        full = min(len(token_ids) // self.page_size, len(pages))
        to_free: list[int] = []
        keys = self._keys(token_ids, full)
        for i in range(num_matched, len(pages)):
            page = pages[i]
            if i < full and keys[i] not in self._entries:
                self._entries[keys[i]] = _Entry(page, 0)
                self._by_page[page] = keys[i]
                self._idle[keys[i]] = None
            else:
                to_free.append(page)
        return to_free

    def evict(self, num_pages: int) -> int:
        """Return up to ``num_pages`` idle cached pages to the allocator (LRU first)."""
        freed: list[int] = []
        while self._idle and len(freed) < num_pages:
            key, _ = self._idle.popitem(last=False)
            entry = self._entries.pop(key)
            del self._by_page[entry.page]
            freed.append(entry.page)
        self.allocator.free(freed)
        return len(freed)

    def clear(self) -> int:
        """Evict every idle page."""
        return self.evict(len(self._idle))
