"""Which decode graphs are captured before an instance is ready, and which after (pure).

Capturing every (batch bucket, page bucket) graph before serving is a large part of a
restart (2.3 s of 11.4 s for a V2-Lite-shaped decode on an H100, 2026-12-05). A restarted
instance is needed at once, and right after a restart its batches are small: the gateway
sends it requests as they come. So only the ``ready_batches`` smallest batch buckets are
captured before ``ready``; the larger ones after it, one graph per gap in which the engine
has nothing to run. Until its graph exists, a step of such a bucket runs the same forward
over the same buffers uncaptured (so its outputs are the graph's), which costs launch time
only. A busy engine that never idles still gets the graphs its steps keep needing: one
needed by :data:`CAPTURE_AFTER_STEPS` uncaptured steps is captured between two steps.
An expert-parallel group captures every graph before ready (``ready_batches`` 0): its ranks
must replay the same graphs in the same steps.

Example: buckets 1, 2, 4, ..., 64 and page buckets 64, 128, 256 with ``ready_batches`` 4
capture (1..8) x (64..256) = 12 graphs before ready and queue (16, 64), (16, 128), ...,
(64, 256) after it, smallest batch first.
"""

from __future__ import annotations

from collections.abc import Sequence

Key = tuple[int, int]  # (batch bucket, page bucket)

# uncaptured steps of a queued graph after which a busy engine captures it between steps
CAPTURE_AFTER_STEPS = 16


def capture_plan(
    batch_buckets: Sequence[int], page_buckets: Sequence[int], ready_batches: int
) -> tuple[list[Key], list[Key]]:
    """(keys captured before ready, keys queued for after), every (batch, page) bucket once.
    Before ready: the ``ready_batches`` smallest batch buckets (0: all of them) at every page
    bucket; after: the other batch buckets, smallest first, each at every page bucket,
    smallest first."""
    if ready_batches < 0:
        raise ValueError(f"ready_batches must be >= 0, got {ready_batches}")
    batches = sorted(batch_buckets)
    pages = sorted(page_buckets)
    k = len(batches) if ready_batches == 0 else min(ready_batches, len(batches))
    before = [(b, p) for p in pages for b in batches[:k]]
    after = [(b, p) for b in batches[k:] for p in pages]
    return before, after


class DeferredCaptures:
    """The graphs queued for after ready (:func:`capture_plan`), and how many steps ran
    uncaptured for want of each. Not thread-safe: the engine thread only."""

    def __init__(self, keys: Sequence[Key]) -> None:
        self._queued = list(keys)
        self._wanted: dict[Key, int] = {}  # queued key -> uncaptured steps so far

    def __len__(self) -> int:
        return len(self._queued)

    @property
    def queued(self) -> list[Key]:
        return list(self._queued)

    def runs_uncaptured(self, key: Key) -> bool:
        """Whether a step of ``key`` must run uncaptured (its graph is queued, not captured);
        counts the step when it must."""
        if key not in self._queued:
            return False
        self._wanted[key] = self._wanted.get(key, 0) + 1
        return True

    def next(self, idle: bool) -> Key | None:
        """The graph to capture now, or None. Idle: the one steps wanted most (the first
        queued when none was wanted). Busy: only one wanted by ``CAPTURE_AFTER_STEPS``
        steps, since a capture stalls the running batch."""
        if not self._queued:
            return None
        wanted = max(self._queued, key=lambda k: self._wanted.get(k, 0))
        count = self._wanted.get(wanted, 0)
        if idle:
            return wanted if count else self._queued[0]
        return wanted if count >= CAPTURE_AFTER_STEPS else None

    def captured(self, key: Key) -> None:
        """``key``'s graph exists: its steps replay it from now on."""
        self._queued.remove(key)
        self._wanted.pop(key, None)
