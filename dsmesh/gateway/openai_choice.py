"""One OpenAI choice as its deltas arrive (text, reasoning, tool calls, logprobs, echo), and
the streamed chunks and usage of a request's choices; shared by chat and completions."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from dsmesh.engine.sampling.token_logprobs import TokenLogprobs
from dsmesh.engine.tokenizer import Tokenizer
from dsmesh.gateway.core import Delta
from dsmesh.gateway.openai_echo import EchoedPrompt, join_logprobs
from dsmesh.gateway.openai_logprobs import LogprobsFormatter
from dsmesh.gateway.reasoning import ReasoningParser, make_reasoning_parser
from dsmesh.gateway.tool_calls import CallDelta, ToolCallParser, merge_call_deltas


class Choice:
    """One choice's text, end and logprobs as its deltas arrive; with a reasoning parser,
    its text split into reasoning and content; with ``parse_tools``, tool calls taken out of
    the content (dsmesh/gateway/tool_calls.py)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        logprobs: bool,
        reasoning_parser: str = "",
        parse_tools: bool = False,
    ) -> None:
        self.parts: list[str] = []
        self.reasoner: ReasoningParser | None = make_reasoning_parser(reasoning_parser)
        self.tool_parser = ToolCallParser() if parse_tools else None
        self.call_ids: list[str] = []  # one per call of tool_parser, made as each appears
        self.new_calls: list[CallDelta] = []
        self.reasoning: list[str] = []
        self.new_reasoning = ""  # what the last delta added to each part
        self.new_content = ""
        self.reason: str | None = None
        self.last: Delta | None = None  # the finishing delta: its usage counts
        self.logprobs = LogprobsFormatter(tokenizer) if logprobs else None
        self.entries: list[TokenLogprobs] = []
        self.sent_any = False
        self.echo: EchoedPrompt | None = None  # completions' echo (dsmesh/gateway/openai_echo.py)
        self.echo_text_due = self.echo_logprobs_due = False

    def start_echo(self, echo: EchoedPrompt) -> None:
        """Put the prompt (and its logprobs, when asked for) before this choice's output."""
        self.echo = echo
        self.echo_text_due = True
        self.echo_logprobs_due = self.logprobs is not None

    def add(self, delta: Delta) -> None:
        if self.echo is not None and delta.prompt_logprobs is not None:
            self.echo.entries = delta.prompt_logprobs  # choice 0's first: before the others'
        if self.reasoner is None:
            self.new_reasoning, self.new_content = "", delta.text
        else:
            self.new_reasoning, self.new_content = self.reasoner.feed(delta.text)
            if delta.finish_reason:
                reasoning, content = self.reasoner.finish()
                self.new_reasoning += reasoning
                self.new_content += content
        if self.tool_parser is not None:
            parsed = self.tool_parser.feed(self.new_content)
            if delta.finish_reason:
                end = self.tool_parser.finish()
                parsed.content += end.content
                parsed.calls += end.calls
            self.new_content, self.new_calls = parsed.content, merge_call_deltas(parsed.calls)
            self.call_ids += [f"call_{uuid.uuid4().hex[:24]}" for c in parsed.calls if c.name]
        if self.echo_text_due and self.echo is not None:
            self.new_content = self.echo.text + self.new_content
            self.echo_text_due = False
        self.reasoning.append(self.new_reasoning)
        self.parts.append(self.new_content)
        self.entries += delta.logprobs or ()
        if delta.finish_reason:
            self.reason = self._finish(delta.finish_reason)
            self.last = delta

    def _finish(self, reason: str) -> str:
        """OpenAI's finish reason: ``tool_calls`` when the model ended after calling tools."""
        if reason == "stop" and self.tool_parser is not None and self.tool_parser.calls:
            return "tool_calls"
        return _finish(reason)

    def rendered(self, entries: list[TokenLogprobs], chat: bool) -> dict[str, Any] | None:
        if self.logprobs is None:
            return None
        if chat:
            return self.logprobs.chat(entries)
        if self.echo_logprobs_due and self.echo is not None:  # the first rendered: the prompt's
            self.echo_logprobs_due = False
            prompt = self.echo.logprobs(self.logprobs)
            return join_logprobs(prompt, self.logprobs.completion(entries))
        return self.logprobs.completion(entries)

    def whole(self, index: int, chat: bool) -> dict[str, Any]:
        text = "".join(self.parts)
        out: dict[str, Any] = {"index": index}
        if chat:
            out["message"] = {"role": "assistant", "content": text}
            if self.reasoner is not None:
                out["message"]["reasoning_content"] = "".join(self.reasoning) or None
            if self.tool_parser is not None and self.tool_parser.calls:
                out["message"]["content"] = text or None  # OpenAI's null beside tool calls
                out["message"]["tool_calls"] = [
                    {
                        "id": self.call_ids[i],
                        "type": "function",
                        "function": {"name": call.name, "arguments": call.arguments},
                    }
                    for i, call in enumerate(self.tool_parser.calls)
                ]
        else:
            out["text"] = text
        out["finish_reason"] = self.reason
        out["logprobs"] = self.rendered(self.entries, chat)
        return out

    def part(self, delta: Delta, chat: bool) -> dict[str, Any] | None:
        """The chunk's entry for ``delta``; None when it carries nothing to send yet."""
        finish = self._finish(delta.finish_reason) if delta.finish_reason else None
        new = bool(self.new_reasoning or self.new_content or self.new_calls)
        if not (new or delta.logprobs or finish or not self.sent_any):
            return None
        out: dict[str, Any] = {"index": delta.index}
        if chat:
            message: dict[str, Any] = {} if self.sent_any else {"role": "assistant"}
            if self.new_reasoning:
                message["reasoning_content"] = self.new_reasoning
            if self.new_content:
                message["content"] = self.new_content
            if self.new_calls:
                message["tool_calls"] = [self._call_delta(c) for c in self.new_calls]
            out["delta"] = message
        else:
            out["text"] = self.new_content
        out["finish_reason"] = finish
        out["logprobs"] = self.rendered(delta.logprobs or [], chat)
        self.sent_any = True
        return out

    def _call_delta(self, call: CallDelta) -> dict[str, Any]:
        """A streamed ``delta.tool_calls`` entry: a call's first has its id, type and name
        (and the arguments that came with them, maybe ""), the later ones argument fragments."""
        if call.name is None:
            return {"index": call.index, "function": {"arguments": call.arguments}}
        return {
            "index": call.index,
            "id": self.call_ids[call.index],
            "type": "function",
            "function": {"name": call.name, "arguments": call.arguments},
        }


async def chunks(
    head: dict[str, Any],
    deltas: AsyncIterator[Delta],
    choices: list[Choice],
    chat: bool,
    include_usage: bool,
    per_prompt: int = 0,
) -> AsyncIterator[dict[str, Any]]:
    """SSE chunks: one per delta that carries something, each for one choice; with
    ``include_usage`` a last chunk with no choices and the usage of all of them
    (``per_prompt``: see :func:`choices_usage`)."""
    async for delta in deltas:
        choice = choices[delta.index]
        choice.add(delta)
        part = choice.part(delta, chat)
        if part is None:
            continue
        out = {**head, "created": int(time.time()), "choices": [part]}
        if include_usage:
            out["usage"] = None
        yield out
    if include_usage and all(c.last is not None for c in choices):
        yield {
            **head,
            "created": int(time.time()),
            "choices": [],
            "usage": choices_usage(choices, per_prompt),
        }


def choices_usage(choices: list[Choice], per_prompt: int = 0) -> dict[str, Any]:
    """Each prompt counted once (its first choice's tokens and cache hits), the completions of
    every choice. ``per_prompt``: choices per prompt of a batch (0: one prompt)."""
    ends = [c.last for c in choices if c.last is not None]
    if not ends:
        return {}
    per = per_prompt or len(choices)
    firsts = [c.last for c in choices[::per] if c.last is not None]
    completion = sum(d.completion_tokens for d in ends)
    prompt = sum(d.prompt_tokens for d in firsts)
    usage = _usage(prompt, completion, sum(d.cached_tokens for d in firsts))
    if moved := sum(d.migrations for d in ends):  # dsmesh's own: docs/RELIABILITY.md
        usage["migrations"] = moved
    return usage


def _finish(reason: str) -> str:
    return {"length": "length", "stop": "stop"}.get(reason, reason)


def _usage(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
