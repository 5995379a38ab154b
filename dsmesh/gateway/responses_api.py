"""OpenAI's Responses API: ``POST /v1/responses`` (streamed or not) and ``GET
/v1/responses/{id}``, as ``client.responses.create`` and ``client.responses.stream`` call them.

A request becomes a chat request and runs through the chat route's path
(``OpenAIRoutes.chat_input``: the chat template, sampling, the tool choice's grammar), so
everything chat does holds here. What maps onto what:

- ``input`` (a string, or items: messages with ``input_text`` / ``output_text`` parts,
  ``function_call`` and ``function_call_output`` items, ``reasoning`` items, which the prompt
  leaves out as V3's template does earlier turns' reasoning) and ``instructions`` (a system
  message, not carried to a follow-up) become the messages;
- ``tools`` (function tools: ``{"type": "function", "name", "parameters", ...}``),
  ``tool_choice`` (``{"type": "function", "name"}`` for a named one), ``parallel_tool_calls``;
- ``text.format`` (``text`` / ``json_object`` / ``json_schema`` with ``name`` and ``schema``)
  becomes ``response_format``; ``max_output_tokens`` the token limit; ``reasoning.effort``
  ``reasoning_effort`` (refused without a reasoning parser, as chat refuses it).

The output is a list of items: a ``reasoning`` item (with ``--reasoning-parser``), a ``message``
with one ``output_text`` part, and a ``function_call`` per call. Streamed, the events are
OpenAI's (``response.created``, ``response.in_progress``, ``response.output_item.added`` /
``.done``, ``response.content_part.added`` / ``.done``, ``response.output_text.delta`` /
``.done``, ``response.reasoning_text.delta`` / ``.done``,
``response.function_call_arguments.delta`` / ``.done``, then ``response.completed``, or
``response.incomplete`` when ``max_output_tokens`` ended it), each with its
``sequence_number``; a failure after the first event is an ``error`` event.
``previous_response_id``: every stored response (``store`` defaults to true) keeps its
conversation (input and output, without ``instructions``) in the gateway's memory for the life
of the process, so a follow-up sends only its new input.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from dsmesh.gateway.choices import generate_choices
from dsmesh.gateway.core import Delta, GatewayError
from dsmesh.gateway.openai_api import OpenAIRoutes, _from_gateway
from dsmesh.gateway.openai_choice import Choice
from dsmesh.gateway.openai_fields import check_fields
from dsmesh.gateway.openai_grammar import EXTRA_FIELDS
from dsmesh.gateway.openai_params import OpenAIError, bad_param, utf8_text
from dsmesh.gateway.tool_calls import CallDelta
from dsmesh.runtime.telemetry import context_from_headers

_SAMPLING_EXTENSIONS = frozenset(
    {"top_k", "min_p", "repetition_penalty", "ignore_eos", "min_tokens", "stop_token_ids", "seed"}
)
RESPONSES_FIELDS = (
    frozenset(
        {
            "model",
            "input",
            "instructions",
            "tools",
            "tool_choice",
            "parallel_tool_calls",
            "text",
            "max_output_tokens",
            "temperature",
            "top_p",
            "stream",
            "stream_options",
            "previous_response_id",
            "reasoning",
            "store",
            "metadata",
            "user",
            "truncation",
            "include",
            "service_tier",
            "safety_identifier",
            "prompt_cache_key",
            "prompt_cache_retention",
            "background",
            "max_tool_calls",
            "top_logprobs",
        }
    )
    | _SAMPLING_EXTENSIONS
    | frozenset(EXTRA_FIELDS)
)
# chat's parameter names as this API's client sent them
_PARAMS = {
    "max_completion_tokens": "max_output_tokens",
    "messages": "input",
    "response_format": "text.format",
    "reasoning_effort": "reasoning.effort",
}


@dataclass
class _Stored:
    response: dict[str, Any]
    conversation: list[dict[str, Any]]  # chat messages: input and output, no instructions


@dataclass
class _Events:
    """The stream's events, numbered in order, and the output items open so far."""

    items: list[dict[str, Any]] = field(default_factory=list)
    open: dict[str, Any] | None = None  # the item deltas go to now
    sequence: int = 0
    out: list[dict[str, Any]] = field(default_factory=list)

    def emit(self, kind: str, **fields: Any) -> None:
        self.out.append({"type": kind, "sequence_number": self.sequence, **fields})
        self.sequence += 1


class ResponsesRoutes:
    def __init__(self, chat: OpenAIRoutes) -> None:
        self.chat = chat
        self.stored: dict[str, _Stored] = {}

    def routes(self) -> list[web.RouteDef]:
        return [
            web.post("/v1/responses", self.create),
            web.get("/v1/responses/{response_id}", self.retrieve),
        ]

    async def retrieve(self, request: web.Request) -> web.Response:
        rid = request.match_info["response_id"]
        stored = self.stored.get(rid)
        if stored is None:
            message = f"No response found with id '{rid}'."
            return OpenAIError(404, message, param="response_id", code="not_found").response()
        return web.json_response(stored.response)

    async def create(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await self.chat._body(request)
            check_fields(body, RESPONSES_FIELDS, self.chat.unknown_fields, "/v1/responses")
            _refuse(body)
            history = self._history(body)
            messages = _input_messages(body.get("input"))
            instructions = body.get("instructions")
            if instructions is not None and not isinstance(instructions, str):
                raise bad_param("instructions", "must be a string")
            system = [{"role": "system", "content": instructions}] if instructions else []
            chat_body = _chat_body(body, system + history + messages)
            inp, tools = self.chat.chat_input(chat_body)
        except OpenAIError as exc:
            return _renamed(exc).response()
        except GatewayError as exc:
            return _renamed(_from_gateway(exc, "messages", chat=True)).response()
        parser = self.chat.reasoning_parser
        choice = Choice(self.chat.core.tokenizer, False, parser, tools.parses)
        rid = f"resp_{uuid.uuid4().hex}"
        created = time.time()
        deltas = generate_choices(self.chat.core, [inp], context_from_headers(request.headers))
        run = _Run(self, body, rid, created, choice, history + messages)
        if body.get("stream"):
            return await run.stream(request, deltas)
        try:
            async for delta in deltas:
                choice.add(delta)
        except GatewayError as exc:
            return _renamed(_from_gateway(exc, "messages", chat=True)).response()
        return web.json_response(run.finish())

    def _history(self, body: dict[str, Any]) -> list[dict[str, Any]]:
        previous = body.get("previous_response_id")
        if previous is None:
            return []
        if not isinstance(previous, str) or previous not in self.stored:
            raise OpenAIError(
                400,
                f"Previous response with id '{previous}' not found.",
                param="previous_response_id",
                code="previous_response_not_found",
            )
        return list(self.stored[previous].conversation)


class _Run:
    """One response: its output items from the choice, its object, its stream of events."""

    def __init__(
        self,
        routes: ResponsesRoutes,
        body: dict[str, Any],
        rid: str,
        created: float,
        choice: Choice,
        conversation: list[dict[str, Any]],
    ) -> None:
        self.routes, self.body, self.rid, self.created = routes, body, rid, created
        self.choice, self.conversation = choice, conversation
        self.ids: dict[str, str] = {}  # item kind -> its id ("reasoning", "message")

    def item_id(self, kind: str) -> str:
        prefix = {"reasoning": "rs", "message": "msg"}[kind]
        return self.ids.setdefault(kind, f"{prefix}_{uuid.uuid4().hex}")

    def response(self, status: str, output: list[dict[str, Any]]) -> dict[str, Any]:
        body = self.body
        last = self.choice.last
        out: dict[str, Any] = {
            "id": self.rid,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "model": body["model"],
            "output": output,
            "error": None,
            "incomplete_details": None,
            "instructions": body.get("instructions"),
            "metadata": body.get("metadata") or {},
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "tool_choice": body.get("tool_choice", "auto"),
            "tools": [_echo_tool(t) for t in body.get("tools") or []],
            "temperature": float(body.get("temperature", 1.0)),
            "top_p": float(body.get("top_p", 1.0)),
            "max_output_tokens": body.get("max_output_tokens"),
            "previous_response_id": body.get("previous_response_id"),
            "reasoning": {"effort": (body.get("reasoning") or {}).get("effort"), "summary": None},
            "text": {"format": (body.get("text") or {}).get("format") or {"type": "text"}},
            "truncation": "disabled",
            "usage": None,
        }
        if status == "incomplete":
            out["incomplete_details"] = {"reason": "max_output_tokens"}
        if last is not None:
            reasoning = "".join(self.choice.reasoning)
            thought = len(self.routes.chat.core.tokenizer.encode(reasoning, False))
            out["usage"] = {
                "input_tokens": last.prompt_tokens,
                "input_tokens_details": {
                    "cached_tokens": last.cached_tokens,
                    "cache_write_tokens": 0,
                },
                "output_tokens": last.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": thought if reasoning else 0},
                "total_tokens": last.prompt_tokens + last.completion_tokens,
            }
        return out

    def output(self) -> list[dict[str, Any]]:
        """The finished output items: reasoning, message, function calls, in that order."""
        items = []
        reasoning = "".join(self.choice.reasoning)
        if reasoning:
            items.append(self.reasoning_item(reasoning, "completed"))
        calls = self.choice.tool_parser.calls if self.choice.tool_parser else []
        text = "".join(self.choice.parts)
        if text or not (calls or reasoning):  # at least one item, a message at worst empty
            items.append(self.message_item(text, "completed"))
        for i, call in enumerate(calls):
            items.append(self.call_item(i, call.name, call.arguments, "completed"))
        return items

    def reasoning_item(self, text: str | None, status: str) -> dict[str, Any]:
        content = [] if text is None else [{"type": "reasoning_text", "text": text}]
        rid = self.item_id("reasoning")
        return {"type": "reasoning", "id": rid, "summary": [], "content": content, "status": status}

    def message_item(self, text: str | None, status: str) -> dict[str, Any]:
        return {
            "type": "message",
            "id": self.item_id("message"),
            "role": "assistant",
            "status": status,
            "content": [] if text is None else [_text_part(text)],
        }

    def call_item(self, index: int, name: str, arguments: str, status: str) -> dict[str, Any]:
        call_id = self.choice.call_ids[index]
        return {
            "type": "function_call",
            "id": f"fc_{call_id.removeprefix('call_')}",
            "call_id": call_id,
            "name": name,
            "arguments": arguments,
            "status": status,
        }

    def finish(self) -> dict[str, Any]:
        """The whole response, stored with its conversation unless ``store: false``."""
        status = "incomplete" if self.choice.reason == "length" else "completed"
        response = self.response(status, self.output())
        if self.body.get("store", True):
            calls = self.choice.tool_parser.calls if self.choice.tool_parser else []
            turn: dict[str, Any] = {"role": "assistant", "content": "".join(self.choice.parts)}
            if calls:
                turn["tool_calls"] = [
                    {
                        "id": self.choice.call_ids[i],
                        "type": "function",
                        "function": {"name": c.name, "arguments": c.arguments},
                    }
                    for i, c in enumerate(calls)
                ]
            self.routes.stored[self.rid] = _Stored(response, [*self.conversation, turn])
        return response

    async def stream(
        self, request: web.Request, deltas: AsyncIterator[Delta]
    ) -> web.StreamResponse:
        """The events; a failure before the first token is an HTTP error, later an
        ``error`` event."""
        iterator = deltas.__aiter__()
        try:
            first = await anext(iterator, None)
        except GatewayError as exc:
            return _renamed(_from_gateway(exc, "messages", chat=True)).response()
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await resp.prepare(request)
        events = _Events()
        events.emit("response.created", response=self.response("in_progress", []))
        events.emit("response.in_progress", response=self.response("in_progress", []))
        try:
            delta = first
            while delta is not None:
                self.choice.add(delta)
                self.step(events)
                if delta.finish_reason:
                    self.close(events)
                    response = self.finish()
                    kind = f"response.{response['status']}"
                    events.emit(kind, response=response)
                await _write(resp, events)
                delta = await anext(iterator, None)
        except GatewayError as exc:
            error = _renamed(_from_gateway(exc, "messages", chat=True))
            events.emit("error", code=error.code, message=error.message, param=error.param)
        await _write(resp, events)
        await resp.write_eof()
        return resp

    def step(self, events: _Events) -> None:
        """The events of what the last delta added."""
        choice = self.choice
        if choice.new_reasoning:
            self.open(events, "reasoning")
            events.emit(
                "response.reasoning_text.delta",
                item_id=events.open["id"],
                output_index=len(events.items) - 1,
                content_index=0,
                delta=choice.new_reasoning,
            )
            events.open["text"] += choice.new_reasoning
        if choice.new_content:
            self.open(events, "message")
            events.emit(
                "response.output_text.delta",
                item_id=events.open["id"],
                output_index=len(events.items) - 1,
                content_index=0,
                delta=choice.new_content,
                logprobs=[],
            )
            events.open["text"] += choice.new_content
        for call in choice.new_calls:
            self.call_delta(events, call)

    def open(self, events: _Events, kind: str) -> None:
        """Make a ``kind`` item the open one (closing the one before)."""
        if events.open is not None and events.open["type"] == kind:
            return
        self.close(events)
        item = (
            self.reasoning_item(None, "in_progress")
            if kind == "reasoning"
            else self.message_item(None, "in_progress")
        )
        index = len(events.items)
        events.items.append(item)
        events.emit("response.output_item.added", output_index=index, item=item)
        part = {"type": "reasoning_text", "text": ""} if kind == "reasoning" else _text_part("")
        events.emit(
            "response.content_part.added",
            item_id=item["id"],
            output_index=index,
            content_index=0,
            part=part,
        )
        events.open = {"type": kind, "id": item["id"], "text": ""}

    def call_delta(self, events: _Events, call: CallDelta) -> None:
        if call.name is not None:
            self.close(events)
            item = self.call_item(call.index, call.name, "", "in_progress")
            events.items.append(item)
            events.emit("response.output_item.added", output_index=len(events.items) - 1, item=item)
            events.open = {"type": "function_call", "id": item["id"], "text": "", "call": call}
            events.open["name"] = call.name
            events.open["index"] = call.index
        if call.arguments and events.open is not None:
            events.emit(
                "response.function_call_arguments.delta",
                item_id=events.open["id"],
                output_index=len(events.items) - 1,
                delta=call.arguments,
            )
            events.open["text"] += call.arguments

    def close(self, events: _Events) -> None:
        """Finish the open item: its ``.done`` events."""
        current = events.open
        if current is None:
            return
        index = len(events.items) - 1
        text = current["text"]
        if current["type"] == "function_call":
            events.emit(
                "response.function_call_arguments.done",
                item_id=current["id"],
                output_index=index,
                name=current["name"],
                arguments=text,
            )
            item = self.call_item(current["index"], current["name"], text, "completed")
        else:
            reasoning = current["type"] == "reasoning"
            kind = "reasoning_text" if reasoning else "output_text"
            extra = {} if reasoning else {"logprobs": []}
            events.emit(
                f"response.{kind}.done",
                item_id=current["id"],
                output_index=index,
                content_index=0,
                text=text,
                **extra,
            )
            part = {"type": "reasoning_text", "text": text} if reasoning else _text_part(text)
            events.emit(
                "response.content_part.done",
                item_id=current["id"],
                output_index=index,
                content_index=0,
                part=part,
            )
            maker = self.reasoning_item if reasoning else self.message_item
            item = maker(text, "completed")
        events.items[index] = item
        events.emit("response.output_item.done", output_index=index, item=item)
        events.open = None


async def _write(resp: web.StreamResponse, events: _Events) -> None:
    for event in events.out:
        data = json.dumps(event, ensure_ascii=False)
        await resp.write(f"event: {event['type']}\ndata: {data}\n\n".encode())
    events.out.clear()


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _echo_tool(tool: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "function",
        "name": tool.get("name"),
        "description": tool.get("description"),
        "parameters": tool.get("parameters"),
        "strict": tool.get("strict"),
    }


def _refuse(body: dict[str, Any]) -> None:
    """Fields that ask for what the gateway does not do: 400 naming them."""
    if body.get("background"):
        raise bad_param("background", "background responses are not supported")
    if body.get("top_logprobs"):
        raise bad_param("top_logprobs", "logprobs are not supported on /v1/responses yet")
    include = body.get("include")
    if include:
        raise bad_param("include", "no additional output data is supported")
    if body.get("truncation") not in (None, "disabled"):
        raise bad_param("truncation", 'only "disabled" is supported')
    if body.get("max_tool_calls") is not None:
        raise bad_param("max_tool_calls", "not supported")


def _chat_body(body: dict[str, Any], messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat request this response runs as."""
    chat: dict[str, Any] = {"model": body["model"], "messages": messages}
    for name in ("temperature", "top_p", "parallel_tool_calls", *_SAMPLING_EXTENSIONS):
        if body.get(name) is not None:
            chat[name] = body[name]
    for name in EXTRA_FIELDS:
        if body.get(name) is not None:
            chat[name] = body[name]
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise bad_param("tools", "must be a list of function tools")
        chat["tools"] = [_chat_tool(i, t) for i, t in enumerate(tools)]
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise bad_param("tool_choice", 'only {"type": "function", "name": ...} objects')
        choice = {"type": "function", "function": {"name": choice["name"]}}
    if choice is not None:
        chat["tool_choice"] = choice
    text = body.get("text")
    if text is not None:
        if not isinstance(text, dict) or set(text) - {"format", "verbosity"}:
            raise bad_param("text", "only text.format is supported")
        if text.get("verbosity") is not None:
            raise bad_param("text.verbosity", "not supported with this model")
        fmt = text.get("format")
        if fmt is not None:
            chat["response_format"] = _response_format(fmt)
    reasoning = body.get("reasoning")
    if reasoning is not None:
        if not isinstance(reasoning, dict):
            raise bad_param("reasoning", "must be an object")
        if reasoning.get("effort") is not None:
            chat["reasoning_effort"] = reasoning["effort"]
    return chat


def _chat_tool(index: int, tool: Any) -> dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise bad_param(f"tools[{index}].type", "only function tools are supported")
    function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
    return {"type": "function", "function": function}


def _response_format(fmt: Any) -> dict[str, Any]:
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise bad_param("text.format", "type must be text, json_object or json_schema")
    if fmt["type"] != "json_schema":
        return {"type": fmt["type"]}
    spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
    return {"type": "json_schema", "json_schema": spec}


def _input_messages(value: Any) -> list[dict[str, Any]]:
    """``input`` as chat messages: consecutive function calls join one assistant turn."""
    if isinstance(value, str):
        return [{"role": "user", "content": utf8_text("input", value)}]
    if not isinstance(value, list) or not value:
        raise bad_param("input", "must be a string or a non-empty list of items")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        name = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_param(name, "must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise bad_param(f"{name}.role", "must be user, system, developer or assistant")
            out.append({"role": role, "content": _content(name, item.get("content"))})
        elif kind == "function_call":
            call = {
                "id": item.get("call_id"),
                "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments")},
            }
            if not all(isinstance(v, str) for v in (call["id"], *call["function"].values())):
                raise bad_param(name, "needs string call_id, name and arguments")
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls"):
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise bad_param(f"{name}.call_id", "must be a string")
            output = _content(f"{name}.output", item.get("output"))
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": output})
        elif kind == "reasoning":
            continue  # earlier turns' reasoning stays out of the prompt, as in V3's template
        else:
            raise bad_param(f"{name}.type", f"input items of type {kind!r} are not supported")
    return out


def _content(name: str, content: Any) -> str:
    """A message's content: a string, or text parts joined."""
    if isinstance(content, str):
        return utf8_text(name, content)
    if not isinstance(content, list):
        raise bad_param(name, "must be a string or a list of text parts")
    texts = []
    for j, part in enumerate(content):
        ok = isinstance(part, dict) and part.get("type") in ("input_text", "output_text", "text")
        if not ok or not isinstance(part.get("text"), str):
            raise bad_param(f"{name}[{j}]", "only input_text and output_text parts are supported")
        texts.append(part["text"])
    return utf8_text(name, "".join(texts))


def _renamed(exc: OpenAIError) -> OpenAIError:
    """A chat error with the parameter as this API names it (``max_output_tokens``)."""
    param = exc.param
    if param is None:
        return exc
    head, dot, rest = param.partition(".")
    base, bracket, index = head.partition("[")
    new = _PARAMS.get(base, base) + bracket + index + dot + rest
    if base == "tools" and ".function." in param:
        new = new.replace(".function.", ".")
    if new == param:
        return exc
    message = exc.message.replace(param, new, 1)
    return OpenAIError(exc.status, message, param=new, code=exc.code, kind=exc.kind)
