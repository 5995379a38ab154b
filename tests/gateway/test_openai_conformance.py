"""OpenAI conformance through a running mesh (`dsmesh up` with its default model): every
OpenAI route's success responses, streamed chunks and errors validate against the ``openai``
package's own response models in strict mode, with no field those models do not declare
(tests/gateway/openai_conformance.py); every 4xx path answers OpenAI's error object, which the
SDK raises as its own exception class."""

from __future__ import annotations

import json
import urllib.request
from typing import Any

import openai
import pytest
from openai.types import Completion, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.shared import ErrorObject

from tests.gateway.openai_conformance import conform
from tests.gateway.test_gateway import post

pytestmark = pytest.mark.timeout(300)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather of a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 8}},
                "required": ["city"],
            },
        },
    }
]
SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["n"],
    "additionalProperties": False,
}


def raw_post(gw, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    status, raw = post(f"{gw.url}{path}", body)
    return status, json.loads(raw)


def raw_stream(gw, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The ``data:`` events of a streamed request, ``[DONE]`` checked and dropped."""
    req = urllib.request.Request(
        f"{gw.url}{path}",
        data=json.dumps({**body, "stream": True}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        text = resp.read().decode()
    events = [e for e in text.split("\n\n") if e.strip()]
    assert events[-1] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events)
    return [json.loads(e.removeprefix("data: ")) for e in events[:-1]]


def test_models(gw) -> None:
    with urllib.request.urlopen(f"{gw.url}/v1/models", timeout=10) as resp:
        listed = json.loads(resp.read())
    assert set(listed) == {"object", "data"} and listed["object"] == "list"
    for card in listed["data"]:
        conform(Model, card)
    with urllib.request.urlopen(f"{gw.url}/v1/models/{gw.model_name}", timeout=10) as resp:
        assert conform(Model, json.loads(resp.read())).id == gw.model_name


COMPLETIONS = [
    {"prompt": "Hello", "max_tokens": 4},
    {"prompt": ["Hello", "World"], "max_tokens": 3, "n": 2, "seed": 1},
    {"prompt": "Hello", "max_tokens": 3, "logprobs": 2, "echo": True},
    {"prompt": "Hello", "max_tokens": 0, "logprobs": 1, "echo": True},
    {"prompt": [1, 2, 3], "max_tokens": 3, "stop": ["\n"], "logit_bias": {"5": -100}},
]


def completion_nulls_filled(obj: dict[str, Any], echo: bool, streamed: bool) -> dict[str, Any]:
    """The nulls OpenAI's own completions API sends where the SDK's ``Completion`` types
    none, replaced by typed values after checking they are exactly there: a streamed chunk's
    ``finish_reason`` before its choice ends, and with ``echo`` the first prompt token's
    ``token_logprobs`` and ``top_logprobs`` (nothing predicts it)."""
    out = json.loads(json.dumps(obj))
    for choice in out["choices"]:
        if choice["finish_reason"] is None:
            assert streamed
            choice["finish_reason"] = "stop"
        logprobs = choice["logprobs"]
        if logprobs is None:
            continue
        nulls = [i for i, v in enumerate(logprobs["token_logprobs"]) if v is None]
        assert nulls == [i for i, v in enumerate(logprobs["top_logprobs"]) if v is None]
        assert nulls in ([], [0]) and (not nulls or echo)
        if nulls:
            logprobs["token_logprobs"][0], logprobs["top_logprobs"][0] = 0.0, {}
    return out


@pytest.mark.parametrize("body", COMPLETIONS)
def test_completions(gw, body: dict[str, Any]) -> None:
    body = {"model": gw.model_name, "temperature": 0, **body}
    echo = bool(body.get("echo"))
    status, out = raw_post(gw, "/v1/completions", body)
    assert status == 200, out
    parsed = conform(Completion, completion_nulls_filled(out, echo, streamed=False))
    assert parsed.usage is not None and parsed.usage.completion_tokens >= 0
    usage = {"stream_options": {"include_usage": True}}
    chunks = raw_stream(gw, "/v1/completions", {**body, **usage})
    for chunk in chunks:  # the SDK parses completions' chunks as Completion
        conform(Completion, completion_nulls_filled(chunk, echo, streamed=True))
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == out["usage"]


CHATS = [
    {"max_completion_tokens": 4},
    {"max_tokens": 4, "n": 2, "logprobs": True, "top_logprobs": 2, "seed": 3},
    {"max_completion_tokens": 40, "tools": TOOLS, "tool_choice": "required"},
    {
        "max_completion_tokens": 40,
        "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
    },
    {"max_completion_tokens": 8, "tools": TOOLS, "tool_choice": "auto"},
    {
        "max_completion_tokens": 20,
        "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}},
    },
    {"max_completion_tokens": 20, "response_format": {"type": "json_object"}},
]
MESSAGES = [
    {"role": "developer", "content": "Answer briefly."},
    {"role": "user", "content": "Weather in Paris?"},
]


@pytest.mark.parametrize("body", CHATS)
def test_chat_completions(gw, body: dict[str, Any]) -> None:
    body = {"model": gw.model_name, "messages": MESSAGES, "temperature": 0, **body}
    status, out = raw_post(gw, "/v1/chat/completions", body)
    assert status == 200, out
    parsed = conform(ChatCompletion, out)
    if body.get("tool_choice") not in (None, "auto"):
        assert parsed.choices[0].message.tool_calls
    usage = {"stream_options": {"include_usage": True}}
    chunks = raw_stream(gw, "/v1/chat/completions", {**body, **usage})
    for chunk in chunks:
        conform(ChatCompletionChunk, chunk)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == out["usage"]


def test_a_tool_result_turn_renders_and_answers(gw) -> None:
    """The ``tool`` role (a tool's result) after an assistant's tool call, on the default
    model's template."""
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    messages = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"celsius": 21}'},
    ]
    body = {"model": gw.model_name, "messages": messages, "tools": TOOLS, "max_tokens": 4}
    status, out = raw_post(gw, "/v1/chat/completions", body)
    assert status == 200, out
    conform(ChatCompletion, out)


# (path, body, status, param, code, the SDK's exception)
CHAT = {"messages": [{"role": "user", "content": "Hi"}]}
ERRORS = [
    ("/v1/completions", {"prompt": "Hi", "bogus": 1}, 400, "bogus", "unknown_parameter"),
    ("/v1/chat/completions", {**CHAT, "temperature": 3}, 400, "temperature", None),
    ("/v1/chat/completions", {**CHAT, "stop": list("abcde")}, 400, "stop", None),
    (
        "/v1/completions",
        {"prompt": "Hi", "max_tokens": 10**8},
        400,
        "max_tokens",
        "context_length_exceeded",
    ),
    (
        "/v1/chat/completions",
        {**CHAT, "reasoning_effort": "low"},
        400,
        "reasoning_effort",
        "unsupported_parameter",
    ),
    ("/v1/chat/completions", {**CHAT, "logit_bias": {"999999999": 1}}, 400, "logit_bias", None),
    ("/v1/chat/completions", {"messages": []}, 400, "messages", None),
    ("/v1/completions", {"prompt": ["a", 5]}, 400, "prompt[1]", None),
    ("/v1/chat/completions", {**CHAT, "model": "nope"}, 404, "model", "model_not_found"),
]


@pytest.mark.parametrize("path,body,status,param,code", ERRORS)
def test_errors_are_openai_error_objects(gw, path, body, status, param, code) -> None:
    sent = {"model": gw.model_name, **body}
    got, out = raw_post(gw, path, sent)
    assert got == status
    assert set(out) == {"error"}
    error = conform(ErrorObject, out["error"])
    assert (error.param, error.code) == (param, code) and error.message
    assert error.type == "invalid_request_error"
    streamed, out = raw_post(gw, path, {**sent, "stream": True})  # refused before any chunk
    assert streamed == status and out["error"]["param"] == param


def test_unrouted_methods_and_bodies_are_openai_error_objects(gw) -> None:
    cases = [
        ("GET", "/v1/embeddings", None, 404, "not_found"),
        ("GET", "/v1/chat/completions", None, 405, "method_not_allowed"),
        ("GET", "/v1/models/nope", None, 404, "model_not_found"),
        ("POST", "/v1/completions", b"{not json", 400, None),
        ("POST", "/v1/completions", b"x" * (9 << 20), 413, "request_too_large"),
    ]
    for method, path, data, status, code in cases:
        req = urllib.request.Request(f"{gw.url}{path}", data=data, method=method)
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(req, timeout=30)
        assert info.value.code == status, path
        error = conform(ErrorObject, json.loads(info.value.read())["error"])
        assert error.code == code, path


def test_the_sdk_raises_its_own_exceptions(gw) -> None:
    client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(
            model=gw.model_name, messages=CHAT["messages"], extra_body={"bogus": 1}
        )
    assert bad.value.code == "unknown_parameter" and bad.value.param == "bogus"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=gw.model_name, prompt="Hi", max_tokens=10**8)
    assert bad.value.code == "context_length_exceeded"
