"""DeepSeek-V3's tool calls in generated text, parsed into OpenAI ``tool_calls``.

V3 writes its calls as its chat template renders them (tokenizer_config.json, DeepSeek-V3)::

    [content]<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
    ```json
    ARGUMENTS
    ```<｜tool▁call▁end｜>
    <｜tool▁call▁begin｜>...<｜tool▁call▁end｜><｜tool▁calls▁end｜>

Each marker is one added token of V3's tokenizer, and none is ``special``, so the detokenized
text (``skip_special_tokens=True``) keeps them. ``ToolCallParser`` is fed that text delta by
delta and returns what each delta can release: content text and ``CallDelta``s (a call's
name once its header is whole, then fragments of its arguments). The rules, which do not
depend on how the text is split into deltas:

- Outside a ``<｜tool▁calls▁begin｜>`` ... ``<｜tool▁calls▁end｜>`` section, text is content.
  Inside, whitespace before a call or before the section's end is dropped.
- A call exists once its header ``TYPE<｜tool▁sep｜>NAME\\n```json\\n`` is whole (NAME not
  empty and on one line). Its arguments are the text up to ``<｜tool▁call▁end｜>`` (or a
  ``<｜tool▁calls▁end｜>`` / next ``<｜tool▁call▁begin｜>`` that cuts it short, or the end
  of the output), less one closing ``\\n````. They are passed on as the model wrote them.
- Text in a section that does not make a call (a header that is never completed, stray
  markers) is content, markers included: nothing the model wrote is dropped silently.

Pure: text in, deltas out; held back is only text that may still become a marker.
"""

from __future__ import annotations

from dataclasses import dataclass, field

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"
ARGS_OPEN = "\n```json\n"
ARGS_CLOSE = "\n```"
TOOL_TOKENS = (CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP)

# Markers that end a header that is not whole yet, or a call's arguments.
_CUTS = (CALL_END, CALLS_END, CALL_BEGIN, CALLS_BEGIN)
# Text at the end of the arguments that may still turn out to close them.
_ARGS_TAILS = (*_CUTS, *(ARGS_CLOSE + cut for cut in _CUTS))


@dataclass(frozen=True)
class CallDelta:
    """What one call gained: ``name`` on its first delta only, then argument text."""

    index: int  # the call's position among the output's calls, from 0
    name: str | None
    arguments: str


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # as the model wrote them (JSON when a grammar enforced the call)


@dataclass
class ParsedDelta:
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)


def _partial_suffix(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of some marker."""
    best = 0
    for marker in markers:
        for n in range(min(len(text), len(marker) - 1), best, -1):
            if marker.startswith(text[-n:]):
                best = n
                break
    return best


def _first(text: str, markers: tuple[str, ...]) -> int:
    """Index of the first occurrence of any of ``markers`` in ``text``; -1 when none."""
    found = [i for i in (text.find(m) for m in markers) if i >= 0]
    return min(found, default=-1)


class ToolCallParser:
    """One choice's output, fed delta by delta: ``feed`` and then ``finish`` return a
    ``ParsedDelta``; ``calls`` holds every call seen so far, whole or not."""

    def __init__(self) -> None:
        self._state = "content"  # content -> section <-> header -> arguments -> section
        self._fresh = True  # in a section: nothing since the last call (or its start) yet
        self._buf = ""
        self._sent = 0  # characters of the current call's arguments already returned
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> ParsedDelta:
        self._buf += text
        out = ParsedDelta()
        self._run(out, final=False)
        return out

    def finish(self) -> ParsedDelta:
        """The output ended: what was held back is released as what it is by now."""
        out = ParsedDelta()
        self._run(out, final=True)
        return out

    def _run(self, out: ParsedDelta, final: bool) -> None:
        step = {
            "content": self._content,
            "section": self._section,
            "header": self._header,
            "arguments": self._arguments,
        }
        while step[self._state](out, final):
            pass

    # Each step consumes from the buffer; it returns True when the state changed and the
    # rest of the buffer should be looked at again.

    def _content(self, out: ParsedDelta, final: bool) -> bool:
        begin = self._buf.find(CALLS_BEGIN)
        if begin >= 0:
            out.content += self._buf[:begin]
            self._buf = self._buf[begin + len(CALLS_BEGIN) :]
            self._state, self._fresh = "section", True
            return True
        keep = 0 if final else _partial_suffix(self._buf, (CALLS_BEGIN,))
        out.content += self._buf[: len(self._buf) - keep]
        self._buf = self._buf[len(self._buf) - keep :]
        return False

    def _section(self, out: ParsedDelta, final: bool) -> bool:
        if self._fresh:
            rest = self._buf.lstrip()
            for marker, state in ((CALL_BEGIN, "header"), (CALLS_END, "content")):
                if rest.startswith(marker):
                    self._buf = rest[len(marker) :]
                    self._state = state
                    return True
            if not rest:
                if final:
                    self._buf = ""  # whitespace alone at the end of the output: dropped
                return False
            if not final and any(m.startswith(rest) for m in (CALL_BEGIN, CALLS_END)):
                return False  # may still be a marker
            self._fresh = False
        cut = _first(self._buf, (CALL_BEGIN, CALLS_END))
        if cut == 0:  # a marker after content in the section
            self._fresh = True
            return True
        if cut > 0:
            out.content += self._buf[:cut]
            self._buf = self._buf[cut:]
            self._fresh = True
            return True
        keep = 0 if final else _partial_suffix(self._buf, (CALL_BEGIN, CALLS_END))
        out.content += self._buf[: len(self._buf) - keep]
        self._buf = self._buf[len(self._buf) - keep :]
        return False

    def _header(self, out: ParsedDelta, final: bool) -> bool:
        buf = self._buf
        cut = _first(buf, _CUTS)
        sep = buf.find(SEP)
        opened = -1 if sep < 0 else buf.find(ARGS_OPEN, sep + len(SEP))
        end = -1 if opened < 0 else opened + len(ARGS_OPEN)
        if end >= 0 and (cut < 0 or cut >= end):
            name = buf[sep + len(SEP) : opened]
            if name and "\n" not in name:
                self.calls.append(ToolCall(name, ""))
                out.calls.append(CallDelta(len(self.calls) - 1, name, ""))
                self._buf, self._sent = buf[end:], 0
                self._state = "arguments"
                return True
        elif cut < 0 and not final:
            return False  # the header may still complete
        # Not a call: its text is content, read again as text of the section.
        out.content += CALL_BEGIN
        self._state, self._fresh = "section", False
        return True

    def _arguments(self, out: ParsedDelta, final: bool) -> bool:
        cut = _first(self._buf, _CUTS)
        if cut < 0 and not final:
            keep = _partial_suffix(self._buf, _ARGS_TAILS)
            self._emit_arguments(out, self._buf[: len(self._buf) - keep])
            return False
        whole = self._buf if cut < 0 else self._buf[:cut]
        self._emit_arguments(out, whole.removesuffix(ARGS_CLOSE))
        rest = "" if cut < 0 else self._buf[cut:]
        self._buf = rest.removeprefix(CALL_END)
        self._state, self._fresh = "section", True
        return cut >= 0

    def _emit_arguments(self, out: ParsedDelta, arguments: str) -> None:
        """``arguments``: the current call's arguments as far as known; add the new part."""
        new = arguments[self._sent :]
        if not new:
            return
        self._sent = len(arguments)
        index = len(self.calls) - 1
        call = self.calls[index]
        self.calls[index] = ToolCall(call.name, call.arguments + new)
        out.calls.append(CallDelta(index, None, new))


def merge_call_deltas(deltas: list[CallDelta]) -> list[CallDelta]:
    """``deltas`` with each run of one call's deltas joined into one (a name kept)."""
    merged: list[CallDelta] = []
    for delta in deltas:
        if merged and merged[-1].index == delta.index and delta.name is None:
            last = merged[-1]
            merged[-1] = CallDelta(last.index, last.name, last.arguments + delta.arguments)
        else:
            merged.append(delta)
    return merged


def parse_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """The content and the calls of a whole output (the same as fed in any pieces)."""
    parser = ToolCallParser()
    content = parser.feed(text).content + parser.finish().content
    return content, parser.calls
