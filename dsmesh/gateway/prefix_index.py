"""The gateway's copy of which prompt prefixes each instance's prefix cache holds: pure state.

Prefill, decode and unified instances name every cached page by a chained hash of its whole
prefix (dsmesh/engine/kv/prefix_hashes.py) and answer the registry's ``GetLoad`` polls with the
names cached and evicted since the gateway's cursor. :class:`PrefixIndex` keeps one set of names per
instance from those answers; an instance holds the leading pages of a prompt whose names are
all in its set, so the prompt's cached length there is the run of its names found, times the
page size. A routing hint only: the instance's cache matches tokens, not names.

Every DP rank of an EP group is an instance of its own with its own cache, so ranks are
indexed, and scored, separately.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from dsmesh.engine.kv.prefix_hashes import PrefixChanges, page_hashes


class PromptPages:
    """A prompt's page names, computed once per page size (a waiting request is scored again
    at every pump until it is dispatched)."""

    def __init__(self, token_ids: Sequence[int]) -> None:
        self.token_ids = tuple(token_ids)
        self._names: dict[int, list[int]] = {}

    def names(self, page_size: int) -> list[int]:
        """Names of the pages an instance's cache could serve: full pages, leaving at least
        one token to compute (as ``PrefixCache.match``)."""
        names = self._names.get(page_size)
        if names is None:
            names = page_hashes(self.token_ids[: len(self.token_ids) - 1], page_size)
            self._names[page_size] = names
        return names


@dataclass
class _Held:
    epoch: int
    seq: int
    page_size: int
    names: set[int] = field(default_factory=set)


class PrefixIndex:
    """Page names per instance id, from each instance's digests."""

    def __init__(self) -> None:
        self._held: dict[str, _Held] = {}

    def __len__(self) -> int:
        return len(self._held)

    def cursor(self, instance_id: str) -> tuple[int, int]:
        """``(epoch, seq)`` to ask ``instance_id`` for changes since; ``(0, 0)``: none yet,
        which gets the whole set."""
        held = self._held.get(instance_id)
        return (held.epoch, held.seq) if held is not None else (0, 0)

    def apply(self, instance_id: str, changes: PrefixChanges, page_size: int) -> None:
        """One digest from ``instance_id``: its whole set (``reset``, or a log this copy did
        not follow), or the changes since this copy's cursor."""
        held = self._held.get(instance_id)
        if changes.reset or held is None or held.epoch != changes.epoch:
            self._held[instance_id] = _Held(
                changes.epoch, changes.seq, page_size, set(changes.stored)
            )
            return
        held.names.difference_update(changes.removed)
        held.names.update(changes.stored)
        held.seq = changes.seq
        held.page_size = page_size

    def forget(self, instance_id: str) -> None:
        self._held.pop(instance_id, None)

    def retain(self, instance_ids: Iterable[str]) -> None:
        """Forget every instance not in ``instance_ids``."""
        keep = set(instance_ids)
        for gone in [i for i in self._held if i not in keep]:
            del self._held[gone]

    def num_cached_pages(self, instance_id: str) -> int:
        held = self._held.get(instance_id)
        return len(held.names) if held is not None else 0

    def cached_tokens(self, instance_id: str, prompt: PromptPages) -> int:
        """Leading tokens of ``prompt`` that ``instance_id`` holds (0 when it reported none)."""
        held = self._held.get(instance_id)
        if held is None or not held.names or held.page_size <= 0:
            return 0
        n = 0
        for name in prompt.names(held.page_size):
            if name not in held.names:
                break
            n += 1
        return n * held.page_size

    def hits(self, prompt: PromptPages, instance_ids: Iterable[str]) -> dict[str, int]:
        """:meth:`cached_tokens` of each instance that holds some of ``prompt``."""
        out = {}
        for instance_id in instance_ids:
            tokens = self.cached_tokens(instance_id, prompt)
            if tokens:
                out[instance_id] = tokens
        return out
