"""The OpenAI routes' prompt and default length, in process: OpenAI-shaped messages (tool calls
with null content, tool results, content parts) render through DeepSeek-V3's template to the
ids transformers gives; an omitted ``max_tokens`` means the room left in the context after the
prompt, no more than the largest instance's KV pool."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from dsmesh.engine.model.tiny_model import tiny_config
from dsmesh.engine.tokenizer import Tokenizer
from dsmesh.gateway.admission import MeshLoads
from dsmesh.gateway.core import CoreLimits, GenerationCore
from dsmesh.gateway.metrics import GatewayMetrics
from dsmesh.gateway.openai_api import OpenAIError, _messages, _tools, sampling_from_openai
from dsmesh.gateway.registry import InstanceRegistry
from dsmesh.gateway.routing import DecodeLoad, PrefillLoad, largest_request_tokens
from tests.engine.deepseek_checkpoint import VOCAB_SIZE, write_deepseek_tokenizer
from tests.mesh import free_port

# As the openai SDK sends a conversation with a tool round trip.
OPENAI_MESSAGES: list[dict[str, Any]] = [
    {
        "role": "system",
        "content": [
            {"type": "text", "text": "Use tools. "},
            {"type": "text", "text": "简短回答。"},
        ],
    },
    {"role": "user", "content": "What's the weather in 巴黎 and the time?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_0",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "巴黎"}'},
            },
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_time", "arguments": "{}"},
            },
        ],
    },
    {"role": "tool", "tool_call_id": "call_0", "content": "18°C ☀️"},
    {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
    {"role": "assistant", "content": "18°C and sunny; it is noon."},
    {"role": "user", "content": "谢谢! 🦩"},
]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_deepseek_tokenizer(tmp_path_factory.mktemp("tok"))


def test_openai_messages_render_as_transformers(folder: Path) -> None:
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoTokenizer.from_pretrained(str(folder))
    messages = _messages(OPENAI_MESSAGES)
    assert messages[0]["content"] == "Use tools. 简短回答。"
    assert (
        messages[2]["content"] == ""
        and messages[2]["tool_calls"] == OPENAI_MESSAGES[2]["tool_calls"]
    )
    assert messages[3]["tool_call_id"] == "call_0"
    ids = Tokenizer.from_dir(folder).apply_chat_template(
        messages, tokenize=True, tools=_tools(TOOLS)
    )
    expected = ref.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False, tools=TOOLS
    )
    assert ids == expected
    text = ref.decode(expected)
    assert "<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function" in text
    assert text.endswith("<｜User｜>谢谢! 🦩<｜Assistant｜>")


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        ([{"role": "assistant", "content": None, "tool_calls": "x"}], "messages[0].tool_calls"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], "messages[0].content"),
        ([{"content": "hi"}], "messages[0]"),
        ([], "messages"),
    ],
)
def test_bad_messages_name_the_param(messages: Any, param: str) -> None:
    with pytest.raises(OpenAIError) as info:
        _messages(messages)
    assert info.value.param == param and info.value.status == 400


def test_bad_tools_name_the_param() -> None:
    assert _tools(None) is None
    for tools in ("x", [1], {"type": "function"}):
        with pytest.raises(OpenAIError) as info:
            _tools(tools)
        assert info.value.param == "tools"


def test_omitted_max_tokens_takes_the_default() -> None:
    assert sampling_from_openai({}, 1000).max_new_tokens == 1000
    assert sampling_from_openai({"max_tokens": 7}, 1000).max_new_tokens == 7
    chat = {"max_completion_tokens": 5, "max_tokens": 7}
    assert sampling_from_openai(chat, 1000, "max_completion_tokens").max_new_tokens == 5
    assert sampling_from_openai({"max_tokens": 7}, 9, "max_completion_tokens").max_new_tokens == 7
    with pytest.raises(OpenAIError) as info:
        sampling_from_openai({"max_completion_tokens": 0}, 1000, "max_completion_tokens")
    assert info.value.param == "max_completion_tokens"


def test_largest_request_tokens() -> None:
    unified = DecodeLoad("u", 10, 128, 0, page_size=16)  # 2048 tokens
    decode = DecodeLoad("d", 10, 512, 0, page_size=16)  # 8192 tokens
    prefill = PrefillLoad("p", 0, 0)
    assert largest_request_tokens([], [decode], [unified]) == 2048  # no prefill: decode idle
    assert largest_request_tokens([prefill], [decode], [unified]) == 8192
    assert largest_request_tokens([], [], []) is None
    unknown = DecodeLoad("old", 10, 128, 0)  # page size unknown: it takes any request
    assert largest_request_tokens([], [], [unified, unknown]) is None


@pytest.mark.asyncio  # the registry's channel wants a running loop
async def test_room_to_generate(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = dataclasses.replace(
        tiny_config("v3"), vocab_size=VOCAB_SIZE, max_position_embeddings=1024
    )
    registry = InstanceRegistry(f"127.0.0.1:{free_port()}")  # never started: no loads
    core = GenerationCore(
        registry,
        Tokenizer.from_dir(folder),
        config,
        GatewayMetrics(registry.kv_pages),
        CoreLimits(),
    )
    try:
        assert core.room_to_generate(24) == 1000  # the context left after the prompt
        assert core.room_to_generate(1024) == 1  # no room: prepare refuses the prompt
        pool = DecodeLoad("u", 32, 32, 0, page_size=16)  # 512 tokens
        monkeypatch.setattr(registry, "loads", lambda: MeshLoads(unifieds=(pool,)))
        assert core.room_to_generate(24) == 488  # no more than the largest pool holds
    finally:
        await registry.close()
