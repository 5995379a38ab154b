"""Stop strings over streamed text: emit what is safe, hold back a possible stop prefix."""

from __future__ import annotations


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
