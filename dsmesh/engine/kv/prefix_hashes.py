"""Names of cached prefixes that other processes can read: chained page hashes, and a log of
which ones a prefix cache gained and lost.

A prompt's page ``i`` is named by ``hash((name of page i - 1, tokens of page i))``, from
:data:`ROOT_HASH`: one integer names a whole prefix. A prefix cache records every page it
gains or loses in a :class:`PrefixEventLog`; a reader elsewhere (the gateway, for KV-aware
routing) keeps a copy of the set of names by asking for the changes since its cursor
(:meth:`PrefixEventLog.since`). Names are hints for routing; reuse of KV always goes through
the cache's token match.

No torch here: the gateway imports this module.
"""

from __future__ import annotations

import itertools
import secrets
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

ROOT_HASH = 0  # the chained hash of the empty prefix


def page_hashes(token_ids: Sequence[int], page_size: int) -> list[int]:
    """Chained hashes of the full pages of ``token_ids``: entry i identifies pages 0..i.

    Hashes of tuples of ints do not depend on ``PYTHONHASHSEED``, so every 64-bit CPython
    process computes the same values: they can name prefixes across instances.
    """
    ids = tuple(token_ids)
    h = ROOT_HASH
    out: list[int] = []
    for start in range(0, len(ids) - page_size + 1, page_size):
        h = hash((h, ids[start : start + page_size]))
        out.append(h)
    return out


def prefix_name(token_ids: Sequence[int], num_pages: int, page_size: int) -> int:
    """The name of the first ``num_pages`` full pages of ``token_ids`` (the last entry of
    their :func:`page_hashes`; :data:`ROOT_HASH` for none). ValueError when the tokens do not
    fill that many pages."""
    if num_pages < 0 or num_pages * page_size > len(token_ids):
        raise ValueError(
            f"{len(token_ids)} tokens do not fill {num_pages} pages of {page_size} tokens"
        )
    hashes = page_hashes(token_ids[: num_pages * page_size], page_size)
    return hashes[-1] if hashes else ROOT_HASH


@dataclass(frozen=True)
class PrefixChanges:
    """What a reader applies to its copy of a cache's page names to bring it up to date.

    With ``reset`` the copy is dropped first and ``stored`` is the whole set (bounded:
    shallowest pages first, so the set stays closed under prefixes). Otherwise ``stored``
    and ``removed`` are the net changes since the reader's cursor (disjoint). The reader's
    next cursor is ``(epoch, seq)``.
    """

    epoch: int
    seq: int
    reset: bool
    stored: list[int]
    removed: list[int]


def new_epoch() -> int:
    """A random nonzero 63-bit id: a restarted cache never continues an old reader's cursor."""
    return secrets.randbits(63) | 1


class PrefixEventLog:
    """The last ``capacity`` changes to a set of page names, numbered 1, 2, ... in ``epoch``.

    Not thread-safe: the prefix cache's owner (the engine thread) records and reads it.
    """

    def __init__(self, capacity: int, epoch: int | None = None) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be > 0, got {capacity}")
        self.capacity = capacity
        self.epoch = new_epoch() if epoch is None else epoch
        self.seq = 0  # changes recorded so far
        self._log: deque[tuple[int, bool]] = deque(maxlen=capacity)  # (name, stored)

    def stored(self, h: int) -> None:
        self.seq += 1
        self._log.append((h, True))

    def removed(self, h: int) -> None:
        self.seq += 1
        self._log.append((h, False))

    def since(self, epoch: int, seq: int, snapshot: Callable[[int], list[int]]) -> PrefixChanges:
        """The changes after change ``seq`` of ``epoch``; the whole set, from
        ``snapshot(capacity)``, when the cursor is of another epoch, from the future, or older
        than what the log still holds."""
        behind = self.seq - seq
        if epoch != self.epoch or behind < 0 or behind > len(self._log):
            return PrefixChanges(self.epoch, self.seq, True, snapshot(self.capacity), [])
        last: dict[int, bool] = {}
        for h, stored in itertools.islice(reversed(self._log), behind):
            last.setdefault(h, stored)  # newest first: the latest change of each name wins
        stored_ = [h for h, s in last.items() if s]
        removed = [h for h, s in last.items() if not s]
        return PrefixChanges(self.epoch, self.seq, False, stored_, removed)
