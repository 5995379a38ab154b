"""The gateway's HTTP app in process, on loopback: /v1/models/{id} answers OpenAI's Model
object (checked by the openai package's own type) or a 404 ``model_not_found``; unknown
routes and wrong methods answer OpenAI's error JSON; the OpenAI routes hold OpenAI's limits
on ``temperature`` and ``stop``."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import openai
import pytest
from aiohttp import ClientSession
from aiohttp.test_utils import TestServer

from dsmesh.gateway.http_app import build_app
from dsmesh.gateway.openai_api import OPENAI_PATHS, OpenAIRoutes, is_openai_path
from dsmesh.gateway.openai_params import OpenAIError, sampling_from_openai

NAMES = ["deepseek-v3", "org/ds-tiny"]


def fetch(requests: list[tuple[str, str]]) -> list[tuple[int, dict[str, Any], str]]:
    """(status, JSON body, Allow header) of each (method, path) against the app. No route
    asked here reaches the generation core, so the app runs without one."""

    async def main() -> list[tuple[int, dict[str, Any], str]]:
        app = build_app(None, NAMES, 1 << 20)  # type: ignore[arg-type]
        async with TestServer(app, host="127.0.0.1") as server, ClientSession() as http:
            out = []
            for method, path in requests:
                async with http.request(method, server.make_url(path)) as resp:
                    body = await resp.json()  # fails on plain text
                    out.append((resp.status, body, resp.headers.get("Allow", "")))
            return out

    return asyncio.run(main())


def openai_error(body: dict[str, Any], code: str) -> dict[str, Any]:
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["param"] is None
    assert err["code"] == code and isinstance(err["message"], str)
    return err


def test_model_retrieve_is_openai_model_object() -> None:
    (s1, one, _), (s2, slashed, _), (s3, listed, _) = fetch(
        [
            ("GET", "/v1/models/deepseek-v3"),
            ("GET", "/v1/models/org/ds-tiny"),
            ("GET", "/v1/models"),
        ]
    )
    assert s1 == s2 == s3 == 200
    model = openai.types.Model.model_validate(one, strict=True)
    assert (model.id, model.object, model.owned_by) == ("deepseek-v3", "model", "dsmesh")
    assert openai.types.Model.model_validate(slashed, strict=True).id == "org/ds-tiny"
    assert listed["data"] == [one, slashed]  # the same cards /v1/models lists


def test_unknown_model_is_openai_404() -> None:
    [(status, body, _)] = fetch([("GET", "/v1/models/no-such-model")])
    assert status == 404
    err = openai_error(body, "model_not_found")
    assert "no-such-model" in err["message"]


def test_unknown_routes_and_wrong_methods_are_openai_errors() -> None:
    out = fetch(
        [
            ("GET", "/v1/embeddings"),
            ("POST", "/nope"),
            ("POST", "/v1/models"),
            ("GET", "/v1/chat/completions"),
            ("DELETE", "/v1/models/deepseek-v3"),
        ]
    )
    assert [status for status, _, _ in out] == [404, 404, 405, 405, 405]
    for status, body, allow in out:
        openai_error(body, "not_found" if status == 404 else "method_not_allowed")
        if status == 405:
            assert "POST" in allow or "GET" in allow
    assert out[3][2] == "POST" and "GET" in out[2][2]


def test_openai_paths_are_the_routes() -> None:
    routes = OpenAIRoutes(None, NAMES).routes()  # type: ignore[arg-type]
    paths = {route.path for route in routes}  # type: ignore[attr-defined]
    assert paths == OPENAI_PATHS | {"/v1/models/{model:.+}"}
    assert is_openai_path("/v1/models/org/ds-tiny") and is_openai_path("/v1/completions")
    assert not is_openai_path("/v1/generate") and not is_openai_path("/v1/models/")


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"temperature": 2.01}, "temperature"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ],
)
def test_openai_limits_name_the_field(body: dict[str, Any], param: str, chat: bool) -> None:
    with pytest.raises(OpenAIError) as info:
        sampling_from_openai(body, 10, chat=chat)
    assert info.value.status == 400 and info.value.param == param
    assert info.value.message.startswith(f"{param}: ")


def test_openai_limits_themselves_are_accepted() -> None:
    params = sampling_from_openai({"temperature": 2, "stop": ["a", "b", "c", "d"]}, 10)
    assert params.temperature == 2.0 and params.stop == ("a", "b", "c", "d")
    assert sampling_from_openai({"temperature": 0}, 10).temperature == 0.0


def tokenizer_calls(
    tokenizer: Any, context: int, requests: list[tuple[str, str, Any]]
) -> list[tuple[int, dict[str, Any]]]:
    """(status, JSON body) of each (method, path, JSON body) against an app whose core holds
    only what the tokenizer routes read: a real tokenizer and the model's context length."""

    class Core:
        pass

    core = Core()
    core.tokenizer = tokenizer  # type: ignore[attr-defined]
    core.model_config = type("Config", (), {"max_position_embeddings": context})()  # type: ignore[attr-defined]

    async def main() -> list[tuple[int, dict[str, Any]]]:
        app = build_app(core, NAMES, 1 << 20)  # type: ignore[arg-type]
        async with TestServer(app, host="127.0.0.1") as server, ClientSession() as http:
            out = []
            for method, path, body in requests:
                async with http.request(method, server.make_url(path), json=body) as resp:
                    out.append((resp.status, await resp.json()))
            return out

    return asyncio.run(main())


def test_root_tokenizer_routes_follow_vllm(tmp_path) -> None:
    from dsmesh.engine.tokenizer import Tokenizer, write_byte_level_tokenizer

    write_byte_level_tokenizer(tmp_path)
    tok = Tokenizer.from_dir(tmp_path)
    messages = [{"role": "user", "content": "Hi there"}]
    text = "héllo wörld 🦊"
    out = tokenizer_calls(
        tok,
        512,
        [
            ("POST", "/tokenize", {"prompt": text}),
            ("POST", "/tokenize", {"prompt": text, "add_special_tokens": False}),
            ("POST", "/tokenize", {"model": "deepseek-v3", "messages": messages}),
            ("POST", "/detokenize", {"tokens": tok.encode(text, add_special_tokens=False)}),
            ("GET", "/tokenizer_info", None),
            ("POST", "/tokenize", {"prompt": 5}),
            ("POST", "/detokenize", {"tokens": "abc"}),
            ("POST", "/tokenize", {"prompt": "x", "bogus": 1}),
        ],
    )
    ids = tok.encode(text)  # what /v1/completions runs for a string prompt
    assert ids[0] == tok.bos_token_id
    assert out[0] == (200, {"tokens": ids, "count": len(ids), "max_model_len": 512})
    assert out[1][1]["tokens"] == tok.encode(text, add_special_tokens=False) == ids[1:]
    chat = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    assert out[2] == (200, {"tokens": list(chat), "count": len(chat), "max_model_len": 512})
    assert out[3] == (200, {"prompt": text})
    assert out[4] == (
        200,
        {
            "tokenizer_class": "Tokenizer",
            "bos_token": tok.bos_token,
            "eos_token": tok.eos_token,
            "bos_token_id": tok.bos_token_id,
            "eos_token_id": tok.eos_token_id,
            "vocab_size": tok.vocab_size,
            "model_max_length": 512,
            "chat_template": tok.chat_template,
        },
    )
    assert tok.chat_template and tok.bos_token
    for (status, body), param in zip(out[5:], ["prompt", "tokens", "bogus"], strict=True):
        assert status == 400
        assert body["error"]["param"] == param and body["error"]["type"] == "invalid_request_error"


def test_max_tokens_past_the_context_is_openai_context_length_error(tmp_path) -> None:
    from dsmesh.engine.tokenizer import Tokenizer, write_byte_level_tokenizer

    write_byte_level_tokenizer(tmp_path)
    tok = Tokenizer.from_dir(tmp_path)
    messages = [{"role": "user", "content": "Hi there"}]
    prompt = len(tok.encode("Hello"))
    chat = len(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))
    completions = {"model": "deepseek-v3", "prompt": "Hello"}
    long_text = "word " * 300
    out = tokenizer_calls(
        tok,
        64,
        [
            ("POST", "/v1/completions", {**completions, "max_tokens": 100_000_000}),
            ("POST", "/v1/completions", {**completions, "max_tokens": 65 - prompt}),
            (
                "POST",
                "/v1/chat/completions",
                {"model": "deepseek-v3", "messages": messages, "max_completion_tokens": 64},
            ),
            (
                "POST",
                "/v1/chat/completions",
                {"model": "deepseek-v3", "messages": messages, "max_tokens": 64},
            ),
            ("POST", "/v1/completions", {"model": "deepseek-v3", "prompt": long_text}),
        ],
    )
    assert [status for status, _ in out] == [400] * 5
    errors = [body["error"] for _, body in out]
    assert {e["code"] for e in errors} == {"context_length_exceeded"}
    assert {e["type"] for e in errors} == {"invalid_request_error"}
    assert [e["param"] for e in errors] == [
        "max_tokens",
        "max_tokens",
        "max_completion_tokens",
        "max_tokens",
        "prompt",
    ]
    assert errors[0]["message"] == (
        "This model's maximum context length is 64 tokens. However, you requested "
        f"{prompt + 100_000_000} tokens ({prompt} in the messages, 100000000 in the "
        "completion). Please reduce the length of the messages or completion."
    )
    assert f"requested 65 tokens ({prompt} in the messages" in errors[1]["message"]
    assert f"requested {chat + 64} tokens ({chat} in the messages" in errors[2]["message"]
    long_ids = len(tok.encode(long_text))
    assert f"your prompt resulted in {long_ids} tokens" in errors[4]["message"]


def test_pipeline_errors_carry_openai_codes_not_grpc_names() -> None:
    import grpc

    from dsmesh.gateway.core import GatewayError
    from dsmesh.gateway.openai_api import _from_gateway
    from dsmesh.gateway.openai_params import OPENAI_CODES

    # a bad logit_bias id, as the pipeline's vocabulary check words it
    bad_bias = GatewayError(
        grpc.StatusCode.INVALID_ARGUMENT, "sampling.logit_bias: token 999999 is not in the vocab"
    )
    err = _from_gateway(bad_bias)
    assert (err.status, err.param, err.code) == (400, "logit_bias", None)
    full = _from_gateway(GatewayError(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue is full"))
    assert (full.status, full.code, full.kind) == (
        429,
        "rate_limit_exceeded",
        "invalid_request_error",
    )
    gone = _from_gateway(GatewayError(grpc.StatusCode.UNAVAILABLE, "no instance"))
    assert (gone.status, gone.code, gone.kind) == (503, "service_unavailable", "server_error")
    # gRPC names with an OpenAI meaning of their own (not_found, cancelled) may stay
    grpc_only = {s.name.lower() for s in grpc.StatusCode} - {"not_found", "cancelled"}
    for status in grpc.StatusCode:
        code = _from_gateway(GatewayError(status, "x: y")).code
        assert code not in grpc_only, status
        assert code == OPENAI_CODES.get(status)

    async def malformed() -> tuple[int, dict[str, Any]]:
        app = build_app(None, NAMES, 1 << 20)  # type: ignore[arg-type]
        async with TestServer(app, host="127.0.0.1") as server, ClientSession() as http:
            url = server.make_url("/v1/completions")
            async with http.post(url, data=b"{not json") as resp:
                return resp.status, await resp.json()

    status, body = asyncio.run(malformed())
    assert status == 400
    assert body["error"]["code"] is None and body["error"]["param"] == "body"


def post_bodies(
    bodies: list[tuple[str, dict[str, Any]]], **app_options: Any
) -> list[tuple[int, dict[str, Any]]]:
    """(status, JSON body) of each POST (path, body) against the app built with
    ``app_options``; every body here is refused before generation, so no core is needed."""

    async def main() -> list[tuple[int, dict[str, Any]]]:
        app = build_app(None, NAMES, 1 << 20, **app_options)  # type: ignore[arg-type]
        async with TestServer(app, host="127.0.0.1") as server, ClientSession() as http:
            out = []
            for path, body in bodies:
                async with http.post(server.make_url(path), json=body) as resp:
                    out.append((resp.status, await resp.json()))
            return out

    return asyncio.run(main())


CHAT = {"model": NAMES[0], "messages": [{"role": "user", "content": "Hi"}]}
COMPLETION = {"model": NAMES[0], "prompt": "Hi"}


def test_unknown_fields_are_400_naming_them_by_default() -> None:
    out = post_bodies(
        [
            ("/v1/completions", {**COMPLETION, "bogus_field_xyz": 1}),
            ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 4, "bogus": None}),
            ("/v1/chat/completions", {**CHAT, "prompt": "x"}),  # completions' field
            ("/v1/completions", {**COMPLETION, "messages": []}),  # chat's field
        ]
    )
    names = ["bogus_field_xyz", "bogus", "prompt", "messages"]
    for (status, body), name in zip(out, names, strict=True):
        assert status == 400
        assert body["error"] == {
            "message": f"Unrecognized request argument supplied: {name}",
            "type": "invalid_request_error",
            "param": name,
            "code": "unknown_parameter",
        }


def test_unknown_fields_ignored_on_request() -> None:
    """``--unknown-fields ignore`` (vLLM's way): the unknown field is passed over, so the
    request goes on to the next error, the bad prompt."""
    [(status, body)] = post_bodies(
        [("/v1/completions", {**COMPLETION, "bogus_field_xyz": 1, "prompt": 5})],
        unknown_fields="ignore",
    )
    assert status == 400 and body["error"]["param"] == "prompt"


def test_reasoning_effort_needs_a_reasoning_model() -> None:
    """OpenAI refuses ``reasoning_effort`` on a model that does not reason; with a reasoning
    parser it is accepted (the request then fails on its messages, checked later)."""
    effort = {**CHAT, "reasoning_effort": "low"}
    [(status, body)] = post_bodies([("/v1/chat/completions", effort)])
    assert status == 400 and body["error"] == {
        "message": "Unsupported parameter: 'reasoning_effort' is not supported with this model.",
        "type": "invalid_request_error",
        "param": "reasoning_effort",
        "code": "unsupported_parameter",
    }
    out = post_bodies(
        [
            ("/v1/chat/completions", {**effort, "messages": "x"}),
            ("/v1/chat/completions", {**effort, "reasoning_effort": "max"}),
            ("/v1/chat/completions", {**CHAT, "audio": {"voice": "alloy"}}),
            ("/v1/chat/completions", {**CHAT, "modalities": ["text", "audio"]}),
        ],
        reasoning_parser="deepseek-r1",
    )
    params = [body["error"]["param"] for _, body in out]
    assert [s for s, _ in out] == [400] * 4
    assert params == ["messages", "reasoning_effort", "audio", "modalities"]


@pytest.mark.parametrize(
    "prompt,param",
    [
        ([], "prompt"),
        (["a", ""], "prompt[1]"),
        (["a", [1, 2], 3], "prompt[2]"),
        ([[1], [True]], "prompt[1]"),
        (["a"] * 1025, "prompt"),
    ],
)
def test_batched_prompts_name_the_bad_one(prompt: Any, param: str) -> None:
    [(status, body)] = post_bodies([("/v1/completions", {**COMPLETION, "prompt": prompt})])
    assert status == 400 and body["error"]["param"] == param


def test_a_stream_that_fails_after_its_first_chunk_ends_with_openai_error() -> None:
    """rest.sse with the OpenAI routes' late error: the failure is OpenAI's error object as a
    plain ``data:`` event (what the SDK raises as APIError), then ``[DONE]``."""
    import grpc
    from aiohttp import web

    from dsmesh.gateway.core import GatewayError
    from dsmesh.gateway.openai_api import _from_gateway
    from dsmesh.gateway.rest import sse

    async def events():
        yield {"id": "cmpl-1", "choices": []}
        raise GatewayError(grpc.StatusCode.UNAVAILABLE, "decode instance lost")

    async def handler(request: web.Request) -> web.StreamResponse:
        return await sse(
            request, events(), done_marker=True, late_error=lambda e: _from_gateway(e).body()
        )

    async def main() -> str:
        app = web.Application()
        app.router.add_get("/s", handler)
        async with TestServer(app, host="127.0.0.1") as server, ClientSession() as http:
            resp = await http.get(server.make_url("/s"))
            return await resp.text()

    events_out = [e for e in asyncio.run(main()).split("\n\n") if e]
    assert events_out[0] == 'data: {"id": "cmpl-1", "choices": []}'
    assert events_out[-1] == "data: [DONE]"
    error = json.loads(events_out[1].removeprefix("data: "))
    assert error == {
        "error": {
            "message": "decode instance lost",
            "type": "server_error",
            "param": None,
            "code": "service_unavailable",
        }
    }


def test_missing_api_key_is_openai_401() -> None:
    from openai.types.shared import ErrorObject

    from tests.gateway.openai_conformance import conform

    out = post_bodies(
        [("/v1/chat/completions", CHAT), ("/v1/responses", {**CHAT, "input": "x"})],
        api_keys=["k1"],
    )
    for status, body in out:
        assert status == 401
        error = conform(ErrorObject, body["error"])
        assert (error.type, error.code) == ("authentication_error", "invalid_api_key")
