"""OpenAI-compatible routes: /v1/models, /v1/models/{id}, /v1/completions,
/v1/chat/completions, and vLLM's and SGLang's /v1/tokenize and /v1/detokenize (also at
vLLM's root paths /tokenize and /detokenize) and vLLM's GET /tokenizer_info.

Follows the OpenAI API's request and response shapes (and its defaults: temperature 1; with
``max_tokens`` omitted, generation runs up to the room left in the context after the prompt),
with vLLM's extensions ``top_k``, ``min_p``, ``repetition_penalty``, ``ignore_eos``,
``min_tokens``, ``stop_token_ids`` (dsmesh/gateway/openai_params.py). Completions' ``echo`` puts the
prompt (and its logprobs) before each choice (dsmesh/gateway/openai_echo.py); ``max_tokens: 0`` asks
for the prompt only (prompt scoring). ``n`` choices run as independent requests sharing the
prompt's KV (dsmesh/gateway/choices.py); logprobs come in OpenAI's chat and completions shapes
(dsmesh/gateway/openai_logprobs.py), streamed too. Chat prompts are the checkpoint's chat template
rendered over the messages as sent (tool calls and tool messages included); with
``--reasoning-parser deepseek-r1`` (dsmesh/gateway/reasoning.py) chat output's ``<think>`` part
goes to
``reasoning_content``. Chat's ``tools`` and ``tool_choice`` (dsmesh/gateway/openai_tools.py): the
output is parsed into ``tool_calls`` (dsmesh/gateway/tool_calls.py), streamed as
``delta.tool_calls``; ``required`` and named choices are enforced by a grammar. What is not
supported yet (suffix, chat's echo) is refused with 400 naming the
parameter.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import Any

import grpc
from aiohttp import web

from dsmesh.gateway.choices import choice_inputs, generate_choices
from dsmesh.gateway.core import GatewayError, GenerationCore, GenerationInput
from dsmesh.gateway.openai_choice import Choice, choices_usage, chunks
from dsmesh.gateway.openai_echo import EchoedPrompt
from dsmesh.gateway.openai_fields import (
    CHAT_FIELDS,
    COMPLETIONS_FIELDS,
    check_chat_capabilities,
    check_fields,
)
from dsmesh.gateway.openai_params import (
    OpenAIError,
    bad_param,
    check_context_length,
    echo,
    include_usage,
    num_choices,
    openai_code,
    openai_param,
    prompt_only,
    read_object,
    refuse_unsupported,
    sampling_from_openai,
    sent_max_tokens_key,
    utf8_text,
)
from dsmesh.gateway.openai_tools import ToolRequest, apply_tool_choice, tool_request
from dsmesh.gateway.rest import http_status, read_json, sse
from dsmesh.runtime.telemetry import context_from_headers

__all__ = ["OpenAIError", "OpenAIRoutes", "is_openai_path", "sampling_from_openai"]

OPENAI_PATHS = frozenset(
    {
        "/v1/models",
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/tokenize",
        "/v1/detokenize",
        "/tokenize",
        "/detokenize",
        "/tokenizer_info",
    }
)
MAX_BATCH_PROMPTS = 1024  # prompts in one /v1/completions batch
MODEL_PREFIX = "/v1/models/"  # /v1/models/{id}; an id may hold slashes (org/name)


def is_openai_path(path: str) -> bool:
    """Whether ``path`` is one of these routes (its errors then come in OpenAI's shape)."""
    return (
        path in OPENAI_PATHS
        or (path.startswith(MODEL_PREFIX) and path != MODEL_PREFIX)
        or path.startswith("/v1/responses")  # dsmesh/gateway/responses_api.py
    )


def _from_gateway(
    exc: GatewayError,
    prompt_param: str = "prompt",
    chat: bool = False,
    max_tokens_key: str = "max_tokens",
) -> OpenAIError:
    """Map a pipeline error; its field names become OpenAI parameter names (the token limit's
    as ``max_tokens_key``, the field the client sent)."""
    status = http_status(exc.code)
    message, param = exc.message, None
    if exc.code == grpc.StatusCode.INVALID_ARGUMENT:
        field, _, rest = message.partition(": ")
        field = {"input_ids": prompt_param, "text": prompt_param}.get(field, field)
        field = openai_param(field.removeprefix("sampling."), chat, max_tokens_key)
        message, param = f"{field}: {rest}", field
    kind = "invalid_request_error" if status < 500 else "server_error"
    return OpenAIError(status, message, param=param, code=openai_code(exc.code), kind=kind)


class OpenAIRoutes:
    def __init__(
        self,
        core: GenerationCore,
        model_name: str | Sequence[str],
        reasoning_parser: str = "",
        unknown_fields: str = "error",
    ) -> None:
        """``model_name``: the served model's names (``--served-model-name``, repeated or a
        comma list); a request may use any, /v1/models lists them all. ``unknown_fields``:
        ``error`` (OpenAI's 400 naming the field) or ``ignore`` (vLLM's way;
        dsmesh/gateway/openai_fields.py)."""
        self.core = core
        self.model_names = served_model_names(model_name)
        if not self.model_names:
            raise ValueError("the gateway needs a served model name")
        self.model_name = self.model_names[0]
        self.reasoning_parser = reasoning_parser  # "" (off) or a dsmesh/gateway/reasoning.py parser
        self.unknown_fields = unknown_fields
        self.created = int(time.time())

    def routes(self) -> list[web.RouteDef]:
        return [
            web.get("/v1/models", self.models),
            web.get(MODEL_PREFIX + "{model:.+}", self.model),
            web.post("/v1/completions", self.completions),
            web.post("/v1/chat/completions", self.chat),
            web.post("/v1/tokenize", self.tokenize),
            web.post("/v1/detokenize", self.detokenize),
            web.post("/tokenize", self.tokenize),  # vLLM's root paths, probed by lm-eval
            web.post("/detokenize", self.detokenize),
            web.get("/tokenizer_info", self.tokenizer_info),
        ]

    async def models(self, request: web.Request) -> web.Response:
        cards = [self._model_card(name) for name in self.model_names]
        return web.json_response({"object": "list", "data": cards})

    async def model(self, request: web.Request) -> web.Response:
        """OpenAI's model retrieval: the card of a served name, else 404 ``model_not_found``."""
        name = request.match_info["model"]
        if name not in self.model_names:
            return OpenAIError(
                404, f"The model '{name}' does not exist", code="model_not_found"
            ).response()
        return web.json_response(self._model_card(name))

    def _model_card(self, name: str) -> dict[str, Any]:
        return {
            "id": name,
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
            raise bad_param("body", "must be a JSON object")
        model = body.get("model")
        if not isinstance(model, str):
            raise bad_param("model", "is required and must be a string")
        if model not in self.model_names:
            raise OpenAIError(
                404, f"The model '{model}' does not exist", param="model", code="model_not_found"
            )
        return body

    # ---- /v1/completions ------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        """One prompt or a batch (strings or token-id lists): each prompt's ``n`` choices,
        numbered prompt by prompt (choice ``p * n + j``), as OpenAI and vLLM number them."""
        try:
            body = await self._body(request)
            check_fields(body, COMPLETIONS_FIELDS, self.unknown_fields, "/v1/completions")
            prompts = _prompts(body.get("prompt"))
            special = _flag(body, "add_special_tokens", True)
            n = num_choices(body)
            usage = include_usage(body)
            only = prompt_only(body, chat=False)
            inputs: list[GenerationInput] = []
            echoes: list[EchoedPrompt | None] = []
            context = self.core.model_config.max_position_embeddings
            for text, ids in prompts:
                if ids is None:
                    ids = self.core.tokenizer.encode(text, add_special_tokens=special)
                check_context_length(body, len(ids), context)
                params = sampling_from_openai(body, self.core.room_to_generate(len(ids)))
                inp = self.core.prepare("", None, ids, params, prompt_only=only)
                inputs += choice_inputs(inp, n)
                echoes += [self._echoed(body, text, inp)] * n
        except OpenAIError as exc:
            return exc.response()
        except GatewayError as exc:
            return _from_gateway(exc).response()
        per = n if len(prompts) > 1 else 0
        return await self._respond(request, body, inputs, False, usage, echoes=echoes, per=per)

    def _echoed(
        self, body: dict[str, Any], text: str | None, inp: GenerationInput
    ) -> EchoedPrompt | None:
        """With ``echo``: the prompt as sent, or its ids as text (special tokens skipped)."""
        if not echo(body, chat=False):
            return None
        tok = self.core.tokenizer
        shown = text if text is not None else tok.decode(inp.prompt_ids, skip_special_tokens=True)
        return EchoedPrompt(shown, inp.prompt_ids)

    # ---- /v1/chat/completions -------------------------------------------------------------

    async def chat(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await self._body(request)
            check_fields(body, CHAT_FIELDS, self.unknown_fields, "/v1/chat/completions")
            n = num_choices(body)
            usage = include_usage(body)
            inp, tools = self.chat_input(body)
        except OpenAIError as exc:
            return exc.response()
        except GatewayError as exc:
            key = sent_max_tokens_key(body, "max_completion_tokens")
            return _from_gateway(exc, "messages", chat=True, max_tokens_key=key).response()
        return await self._respond(request, body, choice_inputs(inp, n), True, usage, tools)

    def chat_input(self, body: dict[str, Any]) -> tuple[GenerationInput, ToolRequest]:
        """A chat request's (one choice's) input and tools: its messages through the chat
        template, its sampling, its tool choice's grammar. Raises OpenAIError or
        GatewayError; the Responses API (dsmesh/gateway/responses_api.py) runs its
        requests through here too."""
        check_chat_capabilities(body, bool(self.reasoning_parser))
        messages = _messages(body.get("messages"))
        tools = tool_request(body)  # dsmesh/gateway/openai_tools.py
        refuse_unsupported(body, chat=True)
        try:
            ids = self.core.tokenizer.apply_chat_template(
                messages,
                add_generation_prompt=True,
                tokenize=True,
                tools=tools.template_tools,
            )
        except Exception as exc:  # template errors are the request's fault
            raise bad_param("messages", f"cannot apply the chat template: {exc}") from exc
        check_context_length(
            body,
            len(ids),
            self.core.model_config.max_position_embeddings,
            "max_completion_tokens",
            "messages",
        )
        params = sampling_from_openai(
            body,
            self.core.room_to_generate(len(ids)),
            max_tokens_key="max_completion_tokens",
            chat=True,
        )
        params = apply_tool_choice(params, tools, self.core.tokenizer)
        return self.core.prepare("", None, list(ids), params), tools

    # ---- /v1/tokenize, /v1/detokenize (vLLM's and SGLang's) ---------------------------------

    async def _extras_body(self, request: web.Request, fields: frozenset[str]) -> dict[str, Any]:
        """A JSON object of only ``fields``; ``model`` optional, but ours when given."""
        body = await read_object(request, fields, _from_gateway)
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise bad_param("model", "must be a string")
        if model is not None and model not in self.model_names:
            raise OpenAIError(
                404, f"The model '{model}' does not exist", param="model", code="model_not_found"
            )
        return body

    async def tokenize(self, request: web.Request) -> web.Response:
        """``prompt`` (text, special tokens added as /v1/completions does unless
        ``add_special_tokens: false``) or ``messages`` (the chat template, with
        ``add_generation_prompt`` default true, and ``tools``) -> the ids /v1/completions and
        /v1/chat/completions would run, their count, and the model's context length."""
        try:
            body = await self._extras_body(request, _TOKENIZE_FIELDS)
            prompt, messages = body.get("prompt"), body.get("messages")
            if (prompt is None) == (messages is None):
                raise bad_param("prompt", "give exactly one of prompt and messages")
            if prompt is not None:
                if body.get("add_generation_prompt") is not None or body.get("tools") is not None:
                    gen = body.get("add_generation_prompt") is not None
                    name = "add_generation_prompt" if gen else "tools"
                    raise bad_param(name, "only with messages")
                if not isinstance(prompt, str):
                    raise bad_param("prompt", "must be a string")
                special = _flag(body, "add_special_tokens", True)
                ids = self.core.tokenizer.encode(utf8_text("prompt", prompt), special)
            else:
                if body.get("add_special_tokens") is not None:
                    raise bad_param("add_special_tokens", "only with prompt")
                generation = _flag(body, "add_generation_prompt", True)
                try:
                    ids = self.core.tokenizer.apply_chat_template(
                        _messages(messages),
                        add_generation_prompt=generation,
                        tokenize=True,
                        tools=_tools(body.get("tools")),
                    )
                except OpenAIError:
                    raise
                except Exception as exc:  # template errors are the request's fault
                    raise bad_param("messages", f"cannot apply the chat template: {exc}") from exc
        except OpenAIError as exc:
            return exc.response()
        tokens = list(ids)
        return web.json_response(
            {
                "tokens": tokens,
                "count": len(tokens),
                "max_model_len": self.core.model_config.max_position_embeddings,
            }
        )

    async def detokenize(self, request: web.Request) -> web.Response:
        """``tokens`` -> ``prompt``: their text, special tokens included (the inverse of
        /v1/tokenize)."""
        try:
            body = await self._extras_body(request, _DETOKENIZE_FIELDS)
            tokens = body.get("tokens")
            if not isinstance(tokens, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in tokens
            ):
                raise bad_param("tokens", "is required and must be a list of token ids")
            vocab = self.core.tokenizer.vocab_size
            for i, token in enumerate(tokens):
                if not 0 <= token < vocab:
                    raise bad_param(f"tokens[{i}]", f"token id {token} is not in [0, {vocab})")
        except OpenAIError as exc:
            return exc.response()
        return web.json_response({"prompt": self.core.tokenizer.decode(tokens)})

    async def tokenizer_info(self, request: web.Request) -> web.Response:
        """vLLM's /tokenizer_info: the tokenizer's class, special tokens, context length and
        default chat template (null when the checkpoint has none)."""
        tok = self.core.tokenizer
        return web.json_response(
            {
                "tokenizer_class": type(tok).__name__,
                "bos_token": tok.bos_token,
                "eos_token": tok.eos_token,
                "bos_token_id": tok.bos_token_id,
                "eos_token_id": tok.eos_token_id,
                "vocab_size": tok.vocab_size,
                "model_max_length": self.core.model_config.max_position_embeddings,
                "chat_template": tok.chat_template,
            }
        )

    # ---- shared ----------------------------------------------------------------------------

    async def _respond(
        self,
        request: web.Request,
        body: dict[str, Any],
        inputs: list[GenerationInput],
        chat: bool,
        include_usage: bool = False,
        tools: ToolRequest | None = None,
        echoes: Sequence[EchoedPrompt | None] = (),
        per: int = 0,
    ) -> web.StreamResponse:
        """Run every choice; one JSON object, or SSE chunks when the body says ``stream``
        (with ``include_usage``, a last chunk of the usage and no choices). ``tools``: chat's,
        whose choice says whether the output is parsed into ``tool_calls``."""
        head = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            "object": "chat.completion" if chat else "text_completion",
            "model": body["model"],  # the name the client used
        }
        parser = self.reasoning_parser if chat else ""
        parse_tools = tools is not None and tools.parses
        choices = [
            Choice(self.core.tokenizer, inp.params.logprobs is not None, parser, parse_tools)
            for inp in inputs
        ]
        for choice, echoed in zip(choices, echoes, strict=False):
            if echoed is not None:  # completions' echo: the prompt before each choice
                choice.start_echo(echoed)
        trace = context_from_headers(request.headers)
        deltas = generate_choices(self.core, inputs, trace, per_prompt=per)
        if body.get("stream"):
            if chat:
                head["object"] = "chat.completion.chunk"
            events = chunks(head, deltas, choices, chat, include_usage, per)
            key = sent_max_tokens_key(body, "max_completion_tokens" if chat else "max_tokens")

            def early_error(exc: GatewayError) -> web.Response:
                return _from_gateway(exc, chat=chat, max_tokens_key=key).response()

            def late_error(exc: GatewayError) -> dict[str, Any]:
                return _from_gateway(exc, chat=chat, max_tokens_key=key).body()

            return await sse(
                request, events, done_marker=True, early_error=early_error, late_error=late_error
            )
        try:
            async for delta in deltas:
                choices[delta.index].add(delta)
        except GatewayError as exc:
            key = sent_max_tokens_key(body, "max_completion_tokens" if chat else "max_tokens")
            return _from_gateway(exc, chat=chat, max_tokens_key=key).response()
        out = {**head, "created": int(time.time())}
        out["choices"] = [c.whole(i, chat) for i, c in enumerate(choices)]
        out["usage"] = choices_usage(choices, per)
        return web.json_response(out)


_TOKENIZE_FIELDS = frozenset(
    {"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt", "tools"}
)
_DETOKENIZE_FIELDS = frozenset({"model", "tokens"})


def served_model_names(names: str | Sequence[str]) -> tuple[str, ...]:
    """``--served-model-name`` values (each maybe a comma list) as names, in order, once each."""
    items = [names] if isinstance(names, str) else list(names)
    out: list[str] = []
    for item in items:
        for name in item.split(","):
            name = name.strip()
            if name and name not in out:
                out.append(name)
    return tuple(out)


def _flag(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_param(name, "must be a boolean")
    return value


def _prompts(prompt: Any) -> list[tuple[str | None, list[int] | None]]:
    """Completions' ``prompt`` as OpenAI takes it: a string, a list of token ids, or a batch
    (a list of strings, or of token-id lists); each as (text, None) or (None, ids)."""
    if isinstance(prompt, str) or _is_ids(prompt):
        return [_prompt("prompt", prompt)]
    if not isinstance(prompt, list) or not prompt:
        raise bad_param(
            "prompt", "must be a string, a list of token ids, or a non-empty list of either"
        )
    if len(prompt) > MAX_BATCH_PROMPTS:
        raise bad_param("prompt", f"at most {MAX_BATCH_PROMPTS} prompts, got {len(prompt)}")
    return [_prompt(f"prompt[{i}]", p) for i, p in enumerate(prompt)]


def _is_ids(prompt: Any) -> bool:
    return (
        isinstance(prompt, list)
        and bool(prompt)
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    )


def _prompt(param: str, prompt: Any) -> tuple[str | None, list[int] | None]:
    if isinstance(prompt, str):
        if not prompt:
            raise bad_param(param, "must not be empty")
        return utf8_text(param, prompt), None
    if _is_ids(prompt):
        return None, list(prompt)
    raise bad_param(param, "must be a non-empty string or list of token ids")


def _messages(messages: Any) -> list[dict[str, Any]]:
    """The conversation for the chat template: each message with every key the client sent
    (``tool_calls``, ``tool_call_id``, ``name``, ...), its content parts joined into one
    string, and a null content as "" (DeepSeek's template renders an assistant turn of tool
    calls with empty content exactly as one with none). OpenAI's ``developer`` role, newer
    than the checkpoints' templates, reaches them as ``system``, as OpenAI treats it."""
    if not isinstance(messages, list) or not messages:
        raise bad_param("messages", "must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad_param(f"messages[{i}]", "must be an object with a string 'role'")
        content = m.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                if not (
                    isinstance(part, dict)
                    and part.get("type") == "text"
                    and isinstance(part.get("text"), str)
                ):
                    raise bad_param(f"messages[{i}].content", "only text parts are supported")
                texts.append(part["text"])
            content = "".join(texts)
        if content is not None and not isinstance(content, str):
            raise bad_param(f"messages[{i}].content", "must be a string or a list of text parts")
        if content:
            utf8_text(f"messages[{i}].content", content)
        tool_calls = m.get("tool_calls")
        if tool_calls is not None and not (
            isinstance(tool_calls, list) and all(isinstance(c, dict) for c in tool_calls)
        ):
            raise bad_param(f"messages[{i}].tool_calls", "must be a list of objects")
        role = "system" if m["role"] == "developer" else m["role"]
        out.append({**m, "role": role, "content": content or ""})
    return out


def _tools(tools: Any) -> list[dict[str, Any]] | None:
    """The request's tool definitions, handed to the chat template as transformers does."""
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise bad_param("tools", "must be a list of objects")
    return tools
