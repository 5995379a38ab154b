"""The OpenAI routes' request fields: sampling, choices, and the fields refused outright.

OpenAI's defaults apply (temperature 1; ``max_tokens`` omitted: the caller's default, the
room left in the context). dsmesh accepts vLLM's extensions ``top_k``, ``min_p``,
``repetition_penalty`` and ``ignore_eos``. OpenAI's limits hold here (``temperature`` in
[0, 2], at most 4 ``stop`` strings), not on /v1/generate or gRPC. Every error is a 400 naming the
parameter as the client sent it.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

import grpc
from aiohttp import web

from dsmesh.engine.errors import InvalidRequestError
from dsmesh.engine.sampling.params import MAX_LOGPROBS, SamplingParams
from dsmesh.gateway.choices import MAX_CHOICES
from dsmesh.gateway.core import GatewayError
from dsmesh.gateway.openai_grammar import grammar_from_openai
from dsmesh.gateway.rest import read_json

# OpenAI's own limits on these routes; /v1/generate and gRPC keep the engine's wider ones
# (dsmesh/runtime/convert.py: 16 stop strings, any temperature >= 0).
MAX_OPENAI_STOP = 4
MAX_OPENAI_TEMPERATURE = 2.0


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

    def body(self) -> dict[str, Any]:
        """OpenAI's error object."""
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> web.Response:
        headers = {"Retry-After": "1"} if self.status in (429, 503) else None
        return web.json_response(self.body(), status=self.status, headers=headers)


# The OpenAI ``error.code`` of a pipeline error's gRPC status (docs/GATEWAY.md, "Error
# codes"): null where OpenAI sends null (a bad parameter, an internal error), else OpenAI's
# or a descriptive name; never a gRPC status name.
OPENAI_CODES: dict[grpc.StatusCode, str | None] = {
    grpc.StatusCode.INVALID_ARGUMENT: None,
    grpc.StatusCode.OUT_OF_RANGE: None,
    grpc.StatusCode.FAILED_PRECONDITION: None,
    grpc.StatusCode.NOT_FOUND: "not_found",
    grpc.StatusCode.ALREADY_EXISTS: "conflict",
    grpc.StatusCode.UNAUTHENTICATED: "invalid_api_key",
    grpc.StatusCode.PERMISSION_DENIED: "insufficient_permissions",
    grpc.StatusCode.RESOURCE_EXHAUSTED: "rate_limit_exceeded",
    grpc.StatusCode.UNAVAILABLE: "service_unavailable",
    grpc.StatusCode.DEADLINE_EXCEEDED: "timeout",
    grpc.StatusCode.CANCELLED: "cancelled",
    grpc.StatusCode.ABORTED: "cancelled",
    grpc.StatusCode.UNIMPLEMENTED: "not_implemented",
}


def openai_code(status: grpc.StatusCode) -> str | None:
    """OpenAI's ``error.code`` for a gRPC status (null for any not listed)."""
    return OPENAI_CODES.get(status)


def bad_param(param: str, message: str) -> OpenAIError:
    return OpenAIError(400, f"{param}: {message}", param=param)


async def read_object(
    request: web.Request,
    fields: Collection[str],
    to_error: Callable[[GatewayError], OpenAIError],
) -> dict[str, Any]:
    """The body as a JSON object of only ``fields``; an OpenAIError naming what is wrong
    (``to_error`` maps a body that is not JSON)."""
    try:
        body = await read_json(request)
    except GatewayError as exc:
        raise to_error(exc) from exc
    if not isinstance(body, dict):
        raise bad_param("body", "must be a JSON object")
    for name in body:
        if name not in fields:
            raise bad_param(name, "unknown field")
    return body


def _get(body: dict[str, Any], name: str, types: tuple[type, ...], default: Any) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in types:
        raise bad_param(name, f"must be of type {'/'.join(t.__name__ for t in types)}")
    if not isinstance(value, types):
        raise bad_param(name, f"must be of type {'/'.join(t.__name__ for t in types)}")
    return value


def utf8_text(param: str, text: str) -> str:
    """JSON may carry unpaired UTF-16 surrogates, which no tokenizer or proto can take."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise bad_param(param, "is not valid Unicode (unpaired surrogate)") from exc
    return text


def _stop_list(body: dict[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        if len(stop) > MAX_OPENAI_STOP:
            raise bad_param("stop", f"at most {MAX_OPENAI_STOP} stop strings, got {len(stop)}")
        return tuple(utf8_text("stop", s) for s in stop)
    raise bad_param("stop", "must be a string or a list of strings")


def _number(body: dict[str, Any], name: str, default: float) -> float:
    try:
        return float(_get(body, name, (int, float), default))
    except OverflowError as exc:
        raise bad_param(name, "is out of range") from exc


def _temperature(body: dict[str, Any]) -> float:
    temperature = _number(body, "temperature", 1.0)
    if not 0 <= temperature <= MAX_OPENAI_TEMPERATURE:  # NaN too
        raise bad_param("temperature", f"must be in [0, 2], got {temperature}")
    return temperature


def _logit_bias(body: dict[str, Any]) -> tuple[tuple[int, float], ...]:
    """``{"<token id>": bias}`` as (id, bias) pairs, ids ascending."""
    bias = body.get("logit_bias")
    if bias is None:
        return ()
    if not isinstance(bias, dict):
        raise bad_param("logit_bias", "must be an object mapping token ids to numbers")
    pairs = []
    for key, value in bias.items():
        try:
            token_id = int(key)
        except ValueError:
            raise bad_param("logit_bias", f"key {key!r} is not a token id") from None
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise bad_param("logit_bias", f"the bias of token {key} must be a number")
        pairs.append((token_id, float(value)))
    return tuple(sorted(pairs))


def _logprobs(body: dict[str, Any], chat: bool) -> int | None:
    """How many top alternatives each token reports (SamplingParams.logprobs). Chat:
    ``logprobs: true`` with ``top_logprobs`` (default 0); completions: integer ``logprobs``."""
    if not chat:
        if body.get("logprobs") is False:  # as "off", which some clients send
            return None
        return _get(body, "logprobs", (int,), None)
    wanted = _get(body, "logprobs", (bool,), False)
    top = _get(body, "top_logprobs", (int,), None)
    if top is not None and not wanted:
        raise bad_param("top_logprobs", "requires logprobs: true")
    if top is not None and not 0 <= top <= MAX_LOGPROBS:
        raise bad_param("top_logprobs", f"must be in [0, {MAX_LOGPROBS}], got {top}")
    return (top or 0) if wanted else None


def sampling_from_openai(
    body: dict[str, Any],
    default_max_tokens: int,
    max_tokens_key: str = "max_tokens",
    chat: bool = False,
) -> SamplingParams:
    """The request's sampling; ``default_max_tokens`` when it sets no ``max_tokens`` (chat:
    ``max_completion_tokens``, else ``max_tokens``)."""
    refuse_unsupported(body, chat)
    max_tokens_key = sent_max_tokens_key(body, max_tokens_key)
    max_tokens = body.get(max_tokens_key)
    if max_tokens is None:
        max_tokens = default_max_tokens
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int):
        raise bad_param(max_tokens_key, "must be an integer")
    seed = _get(body, "seed", (int,), None)
    min_tokens = _get(body, "min_tokens", (int,), 0)
    if prompt_only(body, chat):  # the instance samples one token, which the gateway drops
        if min_tokens:
            raise bad_param("min_tokens", "must be 0 with max_tokens 0 (the prompt only)")
        max_tokens = 1
    logprobs = _logprobs(body, chat)
    try:
        grammar = grammar_from_openai(body)  # response_format, guided_*: structured outputs
    except InvalidRequestError as exc:
        raise bad_param(exc.field, exc.reason) from exc
    params = SamplingParams(
        temperature=_temperature(body),
        top_p=_number(body, "top_p", 1.0),
        top_k=_get(body, "top_k", (int,), 0),
        min_p=_number(body, "min_p", 0.0),
        max_new_tokens=max_tokens,
        seed=seed,
        stop=_stop_list(body),
        ignore_eos=bool(_get(body, "ignore_eos", (bool,), False)),
        presence_penalty=_number(body, "presence_penalty", 0.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0),
        repetition_penalty=_number(body, "repetition_penalty", 1.0),
        logit_bias=_logit_bias(body),
        logprobs=logprobs,
        min_tokens=min_tokens,
        stop_token_ids=_token_ids(body, "stop_token_ids"),
        # echo with logprobs: the prompt's tokens are scored too (the prompt's logprobs)
        prompt_logprobs=logprobs if echo(body, chat) else None,
        grammar=grammar,
    )
    try:
        params.validate()
    except InvalidRequestError as exc:
        raise bad_param(openai_param(exc.field, chat, max_tokens_key), exc.reason) from exc
    return params


def check_context_length(
    body: dict[str, Any],
    prompt_tokens: int,
    context: int,
    max_tokens_key: str = "max_tokens",
    prompt_param: str = "prompt",
) -> None:
    """OpenAI's 400 ``context_length_exceeded`` (its message, as vLLM words it too) when the
    prompt fills the model's context (``param``: ``prompt_param``) or the prompt plus the
    ``max_tokens`` (or ``max_completion_tokens``) the client sent exceeds it (``param``: that
    field), rather than clamping the limit. A field of the wrong type is left to
    :func:`sampling_from_openai`."""
    head = f"This model's maximum context length is {context} tokens. However, "
    if prompt_tokens >= context:
        raise OpenAIError(
            400,
            f"{head}your {'messages' if prompt_param == 'messages' else 'prompt'} resulted in "
            f"{prompt_tokens} tokens, which leaves no room to generate. Please reduce the "
            "length of the messages.",
            param=prompt_param,
            code="context_length_exceeded",
        )
    key = sent_max_tokens_key(body, max_tokens_key)
    requested = body.get(key)
    valid = isinstance(requested, int) and not isinstance(requested, bool)
    if valid and prompt_tokens + requested > context:
        raise OpenAIError(
            400,
            f"{head}you requested {prompt_tokens + requested} tokens ({prompt_tokens} in the "
            f"messages, {requested} in the completion). Please reduce the length of the "
            "messages or completion.",
            param=key,
            code="context_length_exceeded",
        )


def prompt_only(body: dict[str, Any], chat: bool) -> bool:
    """Completions' ``max_tokens: 0``: no new token, the prompt only (with ``echo`` and
    ``logprobs``, prompt scoring as eval harnesses do it); GenerationInput.prompt_only."""
    max_tokens = body.get("max_tokens")
    return not chat and max_tokens == 0 and not isinstance(max_tokens, bool)


def echo(body: dict[str, Any], chat: bool) -> bool:
    """Completions' ``echo``: the prompt comes back before the generated text (and, with
    ``logprobs``, its tokens' logprobs before theirs; dsmesh/gateway/openai_echo.py)."""
    return not chat and bool(_get(body, "echo", (bool,), False))


def _token_ids(body: dict[str, Any], name: str) -> tuple[int, ...]:
    """A list of token ids (vLLM's ``stop_token_ids``)."""
    value = body.get(name)
    if value is None:
        return ()
    if not isinstance(value, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    ):
        raise bad_param(name, "must be a list of token ids")
    return tuple(value)


def sent_max_tokens_key(body: dict[str, Any], max_tokens_key: str = "max_tokens") -> str:
    """The field that sets the request's token limit, as the client sent it: chat's
    ``max_completion_tokens`` wins over its older ``max_tokens``; neither sent: the route's own
    (``max_tokens_key``)."""
    for key in (max_tokens_key, "max_tokens"):
        if body.get(key) is not None:
            return key
    return max_tokens_key


def include_usage(body: dict[str, Any]) -> bool:
    """``stream_options``: only with ``stream: true``, and only ``include_usage`` (a boolean:
    a last chunk with the usage and no choices)."""
    options = body.get("stream_options")
    if options is None:
        return False
    if not body.get("stream"):
        raise bad_param("stream_options", "only allowed with stream: true")
    if not isinstance(options, dict):
        raise bad_param("stream_options", "must be an object")
    for key in options:
        if key != "include_usage":
            raise bad_param(f"stream_options.{key}", "unknown field (only include_usage)")
    value = options.get("include_usage")
    if value is not None and not isinstance(value, bool):
        raise bad_param("stream_options.include_usage", "must be a boolean")
    return bool(value)


def openai_param(field: str, chat: bool, max_tokens_key: str = "max_tokens") -> str:
    """The OpenAI parameter a SamplingParams field came from."""
    if field == "max_new_tokens":
        return max_tokens_key
    if field == "logprobs" and chat:
        return "top_logprobs"
    return field


def num_choices(body: dict[str, Any]) -> int:
    """``n``: how many choices to generate, in [1, 128]. ``best_of`` may only repeat it."""
    n = _get(body, "n", (int,), 1)
    if not 1 <= n <= MAX_CHOICES:
        raise bad_param("n", f"must be in [1, {MAX_CHOICES}], got {n}")
    best_of = _get(body, "best_of", (int,), n)
    if best_of != n:
        raise bad_param("best_of", f"only best_of == n ({n}) is supported, got {best_of}")
    return n


def refuse_unsupported(body: dict[str, Any], chat: bool) -> None:
    """400 naming a field that asks for what the gateway cannot do yet, rather than ignore it:
    the deprecated ``functions`` / ``function_call`` (chat takes ``tools``, checked by
    dsmesh/gateway/openai_tools.py), tools on completions, completions' ``suffix``, and ``echo`` on
    chat (vLLM's echo of the last message is not supported)."""
    if not chat:
        for name in ("tools", "tool_choice", "parallel_tool_calls"):
            if body.get(name) is not None:
                raise bad_param(name, "tool calls are on /v1/chat/completions only")
    if chat:
        for name in ("functions", "function_call"):
            if body.get(name) is not None:
                raise bad_param(name, "deprecated and not supported: use tools and tool_choice")
    if chat and body.get("echo"):
        raise bad_param("echo", "echo is for /v1/completions only")
    if not chat and body.get("suffix"):
        raise bad_param("suffix", "suffix is not supported")
