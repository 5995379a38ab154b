"""Stop strings over streamed text: emit what is safe, hold back a possible stop prefix.

``OutputText`` is the whole path from generated ids to the text a client sees: incremental
detokenization (never half a UTF-8 character), then stop strings.
"""

from __future__ import annotations

from collections.abc import Sequence

from dsmesh.engine.tokenizer import IncrementalDetokenizer, Tokenizer


class StopStringMatcher:
    """Feed decoded text pieces; get back text that can be shown and whether a stop string
    was hit. The stop string itself is never emitted; text that might be the start of a stop
    string is held back until it is decided."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = tuple(s for s in stops if s)
        self._held = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        if self.stopped:
            return ""
        if not self.stops:
            return text
        buf = self._held + text
        cut = min((i for i in (buf.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            self._held = ""
            return buf[:cut]
        keep = self._longest_stop_prefix_suffix(buf)
        self._held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        """End of generation: held text was not a stop string after all."""
        out, self._held = ("" if self.stopped else self._held), ""
        return out

    def _longest_stop_prefix_suffix(self, buf: str) -> int:
        best = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), best, -1):
                if buf.endswith(s[:k]):
                    best = k
                    break
        return best


class OutputText:
    """Generated ids, pushed as they stream, to the text a client sees: decoded without
    special tokens, never splitting a UTF-8 character (``IncrementalDetokenizer``), and cut
    before the first stop string, which may span any number of tokens. Everything returned,
    ``finish()`` included, is ``decode(ids, skip_special_tokens=True)`` up to the first stop
    string (all of it when none matched).

    With ``min_tokens``, the text of the first ``min_tokens`` tokens is never searched for stop
    strings (vLLM too checks them only once more than min_tokens tokens are out; here a stop
    string must lie wholly in the text after those tokens)."""

    def __init__(self, tokenizer: Tokenizer, stops: tuple[str, ...], min_tokens: int = 0) -> None:
        self._detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=True)
        self._stops = StopStringMatcher(stops)
        self._unchecked = min_tokens  # tokens still to come whose text stop strings skip

    @property
    def stopped(self) -> bool:
        """A stop string matched: nothing more will be returned."""
        return self._stops.stopped

    def push(self, ids: Sequence[int]) -> str:
        """Add newly generated ``ids``; return the text that can be shown now."""
        skipped = min(self._unchecked, len(ids))
        if skipped == 0:
            return self._stops.feed(self._detok.push(ids))
        self._unchecked -= skipped
        text = self._detok.push(ids[:skipped])
        return text + (self._stops.feed(self._detok.push(ids[skipped:])) if ids[skipped:] else "")

    def finish(self) -> str:
        """Generation ended: the text held back (a stop string may still match in it)."""
        if self._unchecked > 0:  # ended within min_tokens (aborted): nothing to match
            return self._detok.flush()
        text = self._stops.feed(self._detok.flush())
        return text if self._stops.stopped else text + self._stops.flush()
