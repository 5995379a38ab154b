"""Radix prefix cache of full prompt pages, shared between requests with a common prefix.

The cache is a tree with one node per cached page, as SGLang's RadixCache at page
granularity. A node's children are keyed by their page's tokens (a ``page_size`` tuple), so a
hit is an exact token match: the dict compares the stored block with the prompt's block, and
no two prefixes can alias. Looking up or inserting a prompt walks one node per page: O(pages)
time, no recursion, any depth up to the model's context.

Each node also carries a chained hash of its whole prefix, ``hash((parent_hash, block))`` from
:data:`ROOT_HASH` (:func:`page_hashes` computes the same chain from tokens). The hashes name
prefixes to other processes (KV-aware routing): :meth:`PrefixCache.num_cached_pages_of`
answers from them alone, as a hint, and every page cached or evicted is logged
(``events``, dsmesh/engine/kv/prefix_hashes.py) so that a router can keep a copy of the names
(:meth:`PrefixCache.changes_since`). Reuse of KV always goes through the token match.

Ownership: a page is owned either by exactly one request, or by the cache. :meth:`match`
takes a reference on every page of the matched path; :meth:`release` (or :meth:`insert`, or
:meth:`abandon`) drops it. ``insert`` moves a finished request's full prompt pages into the
cache; pages it did not insert (already cached, or partial) the caller frees. :meth:`share`
moves a running request's computed full pages into the cache early, the request keeping a
reference as if it had matched them, so requests with the same prompt that arrive while it
runs (the n choices of one prompt) share its KV.

Eviction returns unreferenced leaves to the allocator, least recently used first. Idle nodes
(no references) sit in one LRU queue ordered by when they became idle; a path becomes idle
deepest page first, so every idle node is queued after all of its descendants and the queue's
head is always a leaf. Evicting a page therefore never orphans a cached descendant.

Not thread-safe: the scheduler that owns the allocator owns the cache.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from operator import attrgetter

from dsmesh.engine.kv.pool import PageAllocator
from dsmesh.engine.kv.prefix_hashes import ROOT_HASH, PrefixChanges, PrefixEventLog, page_hashes

__all__ = ["ROOT_HASH", "PrefixCache", "PrefixCacheStats", "page_hashes"]

# Page names a reader gets at most in one answer (8 bytes each on the wire): the changes the
# event log keeps, and the size of a whole-set snapshot.
MAX_PAGE_NAMES = 1 << 17


class _Node:
    """One cached page. ``refs`` counts the matches holding it; a parent's ``refs`` is at
    least the sum of its children's, since a match holds its whole path."""

    __slots__ = ("hash", "tokens", "page", "parent", "children", "depth", "refs")

    def __init__(
        self, h: int, tokens: tuple[int, ...], page: int, parent: _Node | None, depth: int
    ) -> None:
        self.hash = h  # chained hash of the prefix ending with this page
        self.tokens = tokens  # this page's tokens: the key in ``parent.children``
        self.page = page
        self.parent = parent
        self.children: dict[tuple[int, ...], _Node] = {}
        self.depth = depth  # pages from the root; the root is 0
        self.refs = 0


_depth = attrgetter("depth")


@dataclass(frozen=True)
class PrefixCacheStats:
    """Counters since the cache was made (``num_*_pages`` other than evicted: current)."""

    num_lookups: int  # admitted requests that looked up their prompt
    num_lookup_tokens: int  # prompt tokens of those lookups
    num_hit_tokens: int  # of which were served from the cache
    num_cached_pages: int
    num_evictable_pages: int
    num_evicted_pages: int

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_lookup_tokens if self.num_lookup_tokens else 0.0


class PrefixCache:
    """Pages of ``allocator`` (``page_size`` tokens each) shared by prompt prefix."""

    def __init__(
        self, allocator: PageAllocator, page_size: int, max_page_names: int = MAX_PAGE_NAMES
    ) -> None:
        if page_size <= 0:
            raise ValueError(f"page_size must be > 0, got {page_size}")
        self.allocator = allocator
        self.page_size = page_size
        self.events = PrefixEventLog(max_page_names)
        self._root = _Node(ROOT_HASH, (), -1, None, 0)
        self._by_page: dict[int, _Node] = {}
        self._by_hash: dict[int, _Node] = {}  # first node cached with each chained hash
        self._idle: OrderedDict[_Node, None] = OrderedDict()  # refs == 0, LRU first
        self.num_lookups = 0
        self.num_lookup_tokens = 0
        self.num_hit_tokens = 0
        self.num_evicted_pages = 0

    @property
    def num_cached_pages(self) -> int:
        return len(self._by_page)

    @property
    def num_evictable_pages(self) -> int:
        return len(self._idle)

    def stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(
            num_lookups=self.num_lookups,
            num_lookup_tokens=self.num_lookup_tokens,
            num_hit_tokens=self.num_hit_tokens,
            num_cached_pages=self.num_cached_pages,
            num_evictable_pages=self.num_evictable_pages,
            num_evicted_pages=self.num_evicted_pages,
        )

    def match(self, token_ids: Sequence[int]) -> list[int]:
        """Pages of the longest cached page-aligned prefix, leaving >= 1 token to compute.

        Takes a reference on each returned page; give them back with :meth:`release` (or
        :meth:`insert` when the request finishes, or :meth:`abandon` if it was not admitted).
        """
        ps = self.page_size
        ids = tuple(token_ids)
        idle = self._idle
        node = self._root
        pages: list[int] = []
        for start in range(0, (len(ids) - 1) // ps * ps, ps):
            child = node.children.get(ids[start : start + ps])
            if child is None:
                break
            if child.refs == 0:
                del idle[child]
            child.refs += 1
            pages.append(child.page)
            node = child
        self.num_lookups += 1
        self.num_lookup_tokens += len(ids)
        self.num_hit_tokens += len(pages) * ps
        return pages

    def abandon(self, token_ids: Sequence[int], pages: list[int]) -> None:
        """Undo a :meth:`match` of ``token_ids`` whose request was not admitted after all:
        drop the references and take the lookup out of the counters."""
        self.release(pages)
        self.num_lookups -= 1
        self.num_lookup_tokens -= len(token_ids)
        self.num_hit_tokens -= len(pages) * self.page_size

    def release(self, pages: list[int]) -> None:
        """Drop one reference on each cached page (from :meth:`match`)."""
        nodes = [self._by_page[p] for p in pages]
        # Deepest first, so a path turns idle (and joins the LRU queue) leaf first.
        nodes.sort(key=_depth, reverse=True)
        for node in nodes:
            if node.refs == 0:
                raise ValueError(f"page {node.page} released more often than matched")
            node.refs -= 1
            if node.refs == 0:
                self._idle[node] = None

    def insert(self, token_ids: Sequence[int], pages: list[int], num_matched: int) -> list[int]:
        """Offer a finished request's pages; returns the pages the caller must still free.

        ``pages[:num_matched]`` came from :meth:`match` (their references are dropped here);
        the request's later full pages of ``token_ids`` become cached where that prefix is not
        cached yet. ``token_ids`` are the tokens whose KV the pages hold.
        """
        ps = self.page_size
        ids = tuple(token_ids)
        full = min(len(ids) // ps, len(pages))
        node = self._by_page[pages[num_matched - 1]] if num_matched else self._root
        to_free = list(pages[full:])
        for i in range(num_matched, full):
            block = ids[i * ps : (i + 1) * ps]
            child = node.children.get(block)
            if child is None:
                child = _Node(hash((node.hash, block)), block, pages[i], node, node.depth + 1)
                node.children[block] = child
                self._by_page[child.page] = child
                self._by_hash.setdefault(child.hash, child)
                self.events.stored(child.hash)
            else:
                to_free.append(pages[i])  # cached meanwhile by another request
            node = child
        # The request used its whole path: the unreferenced part (new pages, and pages other
        # requests cached meanwhile) becomes the most recently used, deepest first (see the
        # module docstring). Above the first referenced node every node is referenced too.
        while node is not self._root and node.refs == 0:
            self._idle[node] = None
            self._idle.move_to_end(node)
            assert node.parent is not None
            node = node.parent
        self.release(pages[:num_matched])
        return to_free

    def share(self, token_ids: Sequence[int], pages: list[int], num_matched: int) -> int:
        """Offer a running request's full pages of ``token_ids`` while it keeps them; returns
        how many leading pages it now holds through the cache (``num_matched`` or more).

        ``pages[:num_matched]`` came from :meth:`match`. Each later full page becomes cached,
        with a reference for the request, until one whose prefix another request cached
        meanwhile: that page and the rest stay the request's own (:meth:`insert` offers them
        when it finishes). A request admitted from now on with the same prefix matches the
        shared pages, whose KV the caller has computed (or queued ahead on the device stream).
        """
        ps = self.page_size
        ids = tuple(token_ids)
        full = min(len(ids) // ps, len(pages))
        node = self._by_page[pages[num_matched - 1]] if num_matched else self._root
        for i in range(num_matched, full):
            block = ids[i * ps : (i + 1) * ps]
            if block in node.children:
                return i
            child = _Node(hash((node.hash, block)), block, pages[i], node, node.depth + 1)
            child.refs = 1  # held by the request, like a matched page
            node.children[block] = child
            self._by_page[child.page] = child
            self._by_hash.setdefault(child.hash, child)
            self.events.stored(child.hash)
            node = child
        return max(num_matched, full)

    def num_cached_pages_of(self, hashes: Sequence[int]) -> int:
        """How many leading pages of a prompt with these :func:`page_hashes` are cached,
        judged by hashes alone: a routing hint, which a hash collision could misjudge."""
        parent = self._root
        for n, h in enumerate(hashes):
            node = self._by_hash.get(h)
            if node is None or node.parent is not parent:
                return n
            parent = node
        return len(hashes)

    def changes_since(self, epoch: int, seq: int) -> PrefixChanges:
        """The page names cached and evicted since a reader's cursor ``(epoch, seq)``, or
        the whole set when the log no longer reaches back that far (see
        :class:`~dsmesh.engine.kv.prefix_hashes.PrefixEventLog`)."""
        return self.events.since(epoch, seq, self.cached_hashes)

    def cached_hashes(self, limit: int) -> list[int]:
        """The names of up to ``limit`` cached pages, shallowest first: every page listed
        has its parent listed before it."""
        out: list[int] = []
        queue = deque(self._root.children.values())
        while queue and len(out) < limit:
            node = queue.popleft()
            out.append(node.hash)
            queue.extend(node.children.values())
        return out

    def evict(self, num_pages: int) -> int:
        """Return up to ``num_pages`` idle cached pages to the allocator (LRU leaves first)."""
        freed: list[int] = []
        idle = self._idle
        while idle and len(freed) < num_pages:
            node, _ = idle.popitem(last=False)
            parent = node.parent
            assert parent is not None and not node.children, "the LRU head must be a leaf"
            del parent.children[node.tokens]
            del self._by_page[node.page]
            if self._by_hash.get(node.hash) is node:
                del self._by_hash[node.hash]
            self.events.removed(node.hash)
            freed.append(node.page)
        self.allocator.free(freed)
        self.num_evicted_pages += len(freed)
        return len(freed)

    def clear(self) -> int:
        """Evict every idle page."""
        return self.evict(len(self._idle))
