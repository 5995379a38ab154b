"""OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions.

Follows the OpenAI API's request and response shapes (and its defaults: temperature 1; with
``max_tokens`` omitted, generation runs up to the room left in the context after the prompt),
with dsmesh extensions ``top_k``, ``min_p``, ``ignore_eos``. Chat prompts are the checkpoint's
chat template rendered over the messages as sent (tool calls and tool messages included).
Unsupported options (n > 1, echo, logprobs, penalties, suffix) are refused with 400 naming the
parameter.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc
from aiohttp import web

from dsmesh.runtime.convert import MAX_STOP_STRINGS
from dsmesh.runtime.telemetry import context_from_headers
from engine.errors import InvalidRequestError
from engine.sampling_params import SamplingParams
from gateway.core import GatewayError, GenerationCore
from gateway.rest import http_status, read_json, sse


class OpenAIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = (
            status,
            message,
            param,
            code,
            kind,
        )

    def response(self) -> web.Response:
        body = {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        }
        headers = {"Retry-After": "1"} if self.status in (429, 503) else None
        return web.json_response(body, status=self.status, headers=headers)


def _from_gateway(exc: GatewayError, prompt_param: str = "prompt") -> OpenAIError:
    """Map a pipeline error; its field names become OpenAI parameter names."""
    status = http_status(exc.code)
    message, param = exc.message, None
    if exc.code == grpc.StatusCode.INVALID_ARGUMENT:
        field, _, rest = message.partition(": ")
        field = {"input_ids": prompt_param, "text": prompt_param}.get(field, field)
        field = field.removeprefix("sampling.")
        field = {"max_new_tokens": "max_tokens"}.get(field, field)
        message, param = f"{field}: {rest}", field
    kind = "invalid_request_error" if status < 500 else "server_error"
    return OpenAIError(status, message, param=param, code=exc.code.name.lower(), kind=kind)


def _bad(param: str, message: str) -> OpenAIError:
    return OpenAIError(400, f"{param}: {message}", param=param)


def _get(body: dict[str, Any], name: str, types: tuple[type, ...], default: Any) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in types:
        raise _bad(name, f"must be of type {'/'.join(t.__name__ for t in types)}")
    if not isinstance(value, types):
        raise _bad(name, f"must be of type {'/'.join(t.__name__ for t in types)}")
    return value


def _utf8(param: str, text: str) -> str:
    """JSON may carry unpaired UTF-16 surrogates, which no tokenizer or proto can take."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise _bad(param, "is not valid Unicode (unpaired surrogate)") from exc
    return text


def _stop_list(body: dict[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        if len(stop) > MAX_STOP_STRINGS:
            raise _bad("stop", f"at most {MAX_STOP_STRINGS} stop strings")
        return tuple(_utf8("stop", s) for s in stop)
    raise _bad("stop", "must be a string or a list of strings")


def _number(body: dict[str, Any], name: str, default: float) -> float:
    try:
        return float(_get(body, name, (int, float), default))
    except OverflowError as exc:
        raise _bad(name, "is out of range") from exc


def sampling_from_openai(
    body: dict[str, Any], default_max_tokens: int, max_tokens_key: str = "max_tokens"
) -> SamplingParams:
    """The request's sampling; ``default_max_tokens`` when it sets no ``max_tokens`` (chat:
    ``max_completion_tokens``, else ``max_tokens``)."""
    for name, ok in (("n", 1), ("best_of", 1)):
        if _get(body, name, (int,), ok) != ok:
            raise _bad(name, "only 1 is supported")
    for name in ("presence_penalty", "frequency_penalty"):
        if _get(body, name, (int, float), 0) != 0:
            raise _bad(name, "penalties are not supported")
    if body.get("logprobs") not in (None, False, 0):
        raise _bad("logprobs", "logprobs are not supported")
    if body.get("echo"):
        raise _bad("echo", "echo is not supported")
    if body.get("suffix"):
        raise _bad("suffix", "suffix is not supported")
    max_tokens = body.get(max_tokens_key)
    if max_tokens is None and max_tokens_key != "max_tokens":
        max_tokens = body.get("max_tokens")
    if max_tokens is None:
        max_tokens = default_max_tokens
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int):
        raise _bad(max_tokens_key, "must be an integer")
    seed = _get(body, "seed", (int,), None)
    params = SamplingParams(
        temperature=_number(body, "temperature", 1.0),
        top_p=_number(body, "top_p", 1.0),
        top_k=_get(body, "top_k", (int,), 0),
        min_p=_number(body, "min_p", 0.0),
        max_new_tokens=max_tokens,
        seed=seed,
        stop=_stop_list(body),
        ignore_eos=bool(_get(body, "ignore_eos", (bool,), False)),
    )
    try:
        params.validate()
    except InvalidRequestError as exc:
        name = max_tokens_key if exc.field == "max_new_tokens" else exc.field
        raise _bad(name, exc.reason) from exc
    return params


class OpenAIRoutes:
    def __init__(self, core: GenerationCore, model_name: str) -> None:
        self.core = core
        self.model_name = model_name
        self.created = int(time.time())

    def routes(self) -> list[web.RouteDef]:
        return [
            web.get("/v1/models", self.models),
            web.post("/v1/completions", self.completions),
            web.post("/v1/chat/completions", self.chat),
        ]

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._model_card()]})

    def _model_card(self) -> dict[str, Any]:
        return {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "dsmesh",
        }

    async def _body(self, request: web.Request) -> dict[str, Any]:
        try:
            body = await read_json(request)
        except GatewayError as exc:
            raise _from_gateway(exc) from exc
        if not isinstance(body, dict):
            raise _bad("body", "must be a JSON object")
        model = body.get("model")
        if not isinstance(model, str):
            raise _bad("model", "is required and must be a string")
        if model != self.model_name:
            raise OpenAIError(
                404, f"The model '{model}' does not exist", param="model", code="model_not_found"
            )
        return body

    # ---- /v1/completions ------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await self._body(request)
            text, ids = _prompt(body.get("prompt"))
            if ids is None:
                ids = self.core.tokenizer.encode(text)
            params = sampling_from_openai(body, self.core.room_to_generate(len(ids)))
            inp = self.core.prepare("", None, ids, params)
        except OpenAIError as exc:
            return exc.response()
        except GatewayError as exc:
            return _from_gateway(exc).response()
        cid = f"cmpl-{uuid.uuid4().hex}"
        stream = bool(body.get("stream"))
        options = body.get("stream_options")
        include_usage = isinstance(options, dict) and bool(options.get("include_usage"))

        def chunk(text: str, finish: str | None) -> dict[str, Any]:
            return {
                "id": cid,
                "object": "text_completion",
                "created": int(time.time()),
                "model": self.model_name,
                "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}],
            }

        if stream:
            return await sse(
                request, self._stream(inp, chunk, include_usage, request), done_marker=True
            )
        try:
            text, reason, usage = await self._collect(inp, request)
        except GatewayError as exc:
            return _from_gateway(exc).response()
        out = chunk(text, reason)
        out["usage"] = usage
        return web.json_response(out)

    # ---- /v1/chat/completions -------------------------------------------------------------

    async def chat(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await self._body(request)
            messages = _messages(body.get("messages"))
            tools = _tools(body.get("tools"))
            try:
                ids = self.core.tokenizer.apply_chat_template(
                    messages, add_generation_prompt=True, tokenize=True, tools=tools
                )
            except Exception as exc:  # template errors are the request's fault
                raise _bad("messages", f"cannot apply the chat template: {exc}") from exc
            params = sampling_from_openai(
                body,
                self.core.room_to_generate(len(ids)),
                max_tokens_key="max_completion_tokens",
            )
            inp = self.core.prepare("", None, list(ids), params)
        except OpenAIError as exc:
            return exc.response()
        except GatewayError as exc:
            return _from_gateway(exc, prompt_param="messages").response()
        cid = f"chatcmpl-{uuid.uuid4().hex}"
        stream = bool(body.get("stream"))
        options = body.get("stream_options")
        include_usage = isinstance(options, dict) and bool(options.get("include_usage"))
        first = [True]

        def chunk(text: str, finish: str | None) -> dict[str, Any]:
            delta: dict[str, Any] = {}
            if first[0]:
                delta["role"] = "assistant"
                first[0] = False
            if text:
                delta["content"] = text
            return {
                "id": cid,
                "object": "chat.completion.chunk",
                "created": int(time.time()),
                "model": self.model_name,
                "choices": [
                    {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
                ],
            }

        if stream:
            return await sse(
                request, self._stream(inp, chunk, include_usage, request), done_marker=True
            )
        try:
            text, reason, usage = await self._collect(inp, request)
        except GatewayError as exc:
            return _from_gateway(exc).response()
        return web.json_response(
            {
                "id": cid,
                "object": "chat.completion",
                "created": int(time.time()),
                "model": self.model_name,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": text},
                        "finish_reason": reason,
                        "logprobs": None,
                    }
                ],
                "usage": usage,
            }
        )

    # ---- shared ----------------------------------------------------------------------------

    async def _collect(self, inp, request: web.Request) -> tuple[str, str, dict[str, int]]:
        parts: list[str] = []
        reason, usage = "stop", {}
        async for delta in self.core.generate(inp, context_from_headers(request.headers)):
            parts.append(delta.text)
            if delta.finish_reason:
                reason = _finish(delta.finish_reason)
                usage = _usage(delta.prompt_tokens, delta.completion_tokens)
        return "".join(parts), reason, usage

    async def _stream(
        self, inp, chunk, include_usage: bool, request: web.Request
    ) -> AsyncIterator[dict[str, Any]]:
        usage = None
        sent_any = False
        async for delta in self.core.generate(inp, context_from_headers(request.headers)):
            finish = _finish(delta.finish_reason) if delta.finish_reason else None
            if delta.text or finish or not sent_any:
                out = chunk(delta.text, finish)
                if include_usage:
                    out["usage"] = None
                yield out
                sent_any = True
            if finish:
                usage = _usage(delta.prompt_tokens, delta.completion_tokens)
        if include_usage and usage is not None:
            last = chunk("", None)
            last["choices"] = []
            last["usage"] = usage
            yield last


def _finish(reason: str) -> str:
    return {"length": "length", "stop": "stop"}.get(reason, reason)


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def _prompt(prompt: Any) -> tuple[str | None, list[int] | None]:
    if isinstance(prompt, str):
        if not prompt:
            raise _bad("prompt", "must not be empty")
        return _utf8("prompt", prompt), None
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        return None, list(prompt)
    if isinstance(prompt, list) and len(prompt) == 1:
        return _prompt(prompt[0])
    if isinstance(prompt, list) and not prompt:
        raise _bad("prompt", "must not be empty")
    raise _bad("prompt", "must be a string or a list of token ids (one prompt per request)")


def _messages(messages: Any) -> list[dict[str, Any]]:
    """The conversation for the chat template: each message with every key the client sent
    (``tool_calls``, ``tool_call_id``, ``name``, ...), its content parts joined into one
    string, and a null content as "" (DeepSeek's template renders an assistant turn of tool
    calls with empty content exactly as one with none)."""
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise _bad(f"messages[{i}]", "must be an object with a string 'role'")
        content = m.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                if not (
                    isinstance(part, dict)
                    and part.get("type") == "text"
                    and isinstance(part.get("text"), str)
                ):
                    raise _bad(f"messages[{i}].content", "only text parts are supported")
                texts.append(part["text"])
            content = "".join(texts)
        if content is not None and not isinstance(content, str):
            raise _bad(f"messages[{i}].content", "must be a string or a list of text parts")
        if content:
            _utf8(f"messages[{i}].content", content)
        tool_calls = m.get("tool_calls")
        if tool_calls is not None and not (
            isinstance(tool_calls, list) and all(isinstance(c, dict) for c in tool_calls)
        ):
            raise _bad(f"messages[{i}].tool_calls", "must be a list of objects")
        out.append({**m, "content": content or ""})
    return out


def _tools(tools: Any) -> list[dict[str, Any]] | None:
    """The request's tool definitions, handed to the chat template as transformers does."""
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise _bad("tools", "must be a list of objects")
    return tools
