"""Reasoning parsers: split a reasoning model's output into its thinking and its answer.

``deepseek-r1`` (as DeepSeek's API and SGLang's ``--reasoning-parser deepseek-r1``): the text
between ``<think>`` and ``</think>`` is the reasoning (OpenAI chat ``reasoning_content``), the
rest the content. R1's chat template already opens ``<think>`` in the generation prompt, so the
output may start inside the thinking with no opening tag: the output is reasoning from its
start until ``</think>`` (an opening ``<think>`` at the very start is dropped), and all of it
when ``</think>`` never comes. Whitespace right after ``</think>`` is dropped, as R1 writes
``</think>\\n\\n`` before its answer.

Pure and incremental: fed the detokenized text deltas, it returns what each can release now,
holding back only text that could still be the start of a tag split across deltas.
"""

from __future__ import annotations

REASONING_PARSERS = ("deepseek-r1",)

THINK_START = "<think>"
THINK_END = "</think>"


def check_reasoning_parser(name: str) -> str:
    """``name`` if it is a known parser or "" (off); ValueError otherwise."""
    if name and name not in REASONING_PARSERS:
        known = ", ".join(REASONING_PARSERS)
        raise ValueError(f"--reasoning-parser: unknown parser {name!r} (known: {known})")
    return name


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReasoningParser:
    """One choice's output, fed delta by delta: ``feed`` and then ``finish`` return
    ``(reasoning, content)``, the text each part gains."""

    def __init__(self) -> None:
        self._state = "start"  # start -> reasoning -> gap (whitespace after </think>) -> content
        self._held = ""

    def feed(self, text: str) -> tuple[str, str]:
        buf = self._held + text
        self._held = ""
        reasoning, content = "", ""
        if self._state == "start":
            if THINK_START.startswith(buf) and len(buf) < len(THINK_START):
                self._held = buf  # could still be the opening tag
                return "", ""
            buf = buf.removeprefix(THINK_START)
            self._state = "reasoning"
        if self._state == "reasoning":
            end = buf.find(THINK_END)
            if end < 0:
                keep = _partial_suffix(buf, THINK_END)
                self._held = buf[len(buf) - keep :]
                return buf[: len(buf) - keep], ""
            reasoning, buf = buf[:end], buf[end + len(THINK_END) :]
            self._state = "gap"
        if self._state == "gap":
            buf = buf.lstrip()
            if not buf:
                return reasoning, ""
            self._state = "content"
        return reasoning, content + buf

    def finish(self) -> tuple[str, str]:
        """What is still held when the output ends: a partial tag is text of its part."""
        held, self._held = self._held, ""
        if self._state in ("start", "reasoning"):
            self._state = "reasoning"
            return held, ""
        return "", held


def make_reasoning_parser(name: str) -> ReasoningParser | None:
    return ReasoningParser() if name == "deepseek-r1" else None
