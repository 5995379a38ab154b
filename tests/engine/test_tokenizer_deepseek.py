"""dsmesh.engine.tokenizer on DeepSeek-V3's real tokenizer and chat template, with transformers 5's
``AutoTokenizer`` on the same checkpoint folder as the reference: ids, text and chat prompts
equal token for token (system prompts, multi-turn, tool calls and tool outputs), and the
streaming detokenizer exact on text whose characters span several tokens."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from dsmesh.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from tests.engine.deepseek_checkpoint import BOS_ID, EOS_ID, write_deepseek_tokenizer

USER, ASSISTANT = "<｜User｜>", "<｜Assistant｜>"
TOOL_CALLS_BEGIN = "<｜tool▁calls▁begin｜>"

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "你好，世界！DeepSeek-V3 于 2024 年 12 月发布。数学：E=mc²，π≈3.14159",
    "日本語のひらがなとカタカナ、한국어 텍스트, Ünïcödé çåfé naïve",
    "emoji 🦜🦩🧑‍🚀👩🏽‍💻 flags 🇫🇷🇯🇵 and rare CJK 龘靐齉 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    (
        'def fib(n: int) -> int:\n    """Fibonacci."""\n'
        "    return n if n < 2 else fib(n - 1) + fib(n - 2)\n"
    ),
    "   leading spaces,\ttabs\n\n\nand 12345678901234567890 digits  ",
    f"special tokens as text: {USER}hi{ASSISTANT}<think>想一想</think>ok<｜end▁of▁sentence｜>",
]

TOOL_CALL = {
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "巴黎", "unit": "C"}'},
}
TOOL_CALL_2 = {"type": "function", "function": {"name": "get_time", "arguments": "{}"}}

CONVERSATIONS: dict[str, list[dict[str, Any]]] = {
    "user": [{"role": "user", "content": "What is the capital of France?"}],
    "system": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Hi there 🙂"},
    ],
    "multi-turn": [
        {"role": "system", "content": "Answer briefly."},
        {"role": "system", "content": "用中文回答。"},
        {"role": "user", "content": "Bonjour, ça va ?"},
        {"role": "assistant", "content": "<think>The user greets.</think>Très bien, merci ! 🦜"},
        {"role": "user", "content": "日本語は？"},
        {"role": "assistant", "content": "少し話せます。", "reasoning_content": "hidden"},
        {"role": "user", "content": "def f(x):\n    return x**2"},
    ],
    "tool-calls": [
        {"role": "user", "content": "Weather and time in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [TOOL_CALL, TOOL_CALL_2]},
        {"role": "tool", "tool_call_id": "call_0", "content": '{"temp": 18}'},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
    ],
    "tool-round-trip": [
        {"role": "system", "content": "Use tools when needed."},
        {"role": "user", "content": "巴黎天气？"},
        {"role": "assistant", "content": "Let me check.", "tool_calls": [TOOL_CALL]},
        {"role": "tool", "tool_call_id": "call_0", "content": "18°C, sunny ☀️"},
        {"role": "assistant", "content": "It is 18°C and sunny."},
        {"role": "user", "content": "Thanks! And tomorrow?"},
    ],
    "none-values": [
        {"role": "user", "content": "one", "name": None},
        {"role": "assistant", "content": "two", "tool_calls": None},
        {"role": "user", "content": "three"},
    ],
}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_deepseek_tokenizer(tmp_path_factory.mktemp("deepseek-v3-tok"))


@pytest.fixture(scope="module")
def tok(folder: Path) -> Tokenizer:
    return Tokenizer.from_dir(folder)


@pytest.fixture(scope="module")
def hf_tok(folder: Path) -> Any:
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(folder))


def hf_chat(hf_tok: Any, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
    return hf_tok.apply_chat_template(messages, tokenize=True, return_dict=False, **kwargs)


# --- the checkpoint's facts ---------------------------------------------------------------------


def test_loads_deepseek_v3_special_tokens_and_template(folder: Path, tok: Tokenizer) -> None:
    config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert config["add_bos_token"] is False
    assert (tok.bos_token_id, tok.eos_token_id, tok.vocab_size) == (BOS_ID, EOS_ID, 128815)
    assert tok.bos_token == "<｜begin▁of▁sentence｜>"
    assert tok.eos_token == "<｜end▁of▁sentence｜>"
    assert tok.chat_template == config["chat_template"] and TOOL_CALLS_BEGIN in tok.chat_template
    assert tok.encode("hi")[0] != BOS_ID  # add_bos_token false: BOS comes from the template
    # The turn and tool tokens are single added tokens, kept when special tokens are skipped.
    for text in (USER, ASSISTANT, TOOL_CALLS_BEGIN, "<think>"):
        [token_id] = tok.encode(text)
        assert tok.decode([token_id], skip_special_tokens=True) == text
    assert tok.decode([BOS_ID, EOS_ID], skip_special_tokens=True) == ""


# --- transformers as the reference --------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(tok: Tokenizer, hf_tok: Any, text: str) -> None:
    for add_special_tokens in (True, False):
        ids = tok.encode(text, add_special_tokens=add_special_tokens)
        assert ids == hf_tok.encode(text, add_special_tokens=add_special_tokens)
        for skip in (True, False):
            assert tok.decode(ids, skip) == hf_tok.decode(ids, skip_special_tokens=skip)
    assert tok.decode(tok.encode(text)) == text


def test_decode_of_random_ids_matches_transformers(tok: Tokenizer, hf_tok: Any) -> None:
    """Arbitrary ids: byte tokens that do not form characters decode to U+FFFD alike."""
    rng = random.Random(0)
    ids = [rng.randrange(tok.vocab_size) for _ in range(3000)]
    for skip in (True, False):
        assert tok.decode(ids, skip) == hf_tok.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("name", list(CONVERSATIONS))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(
    tok: Tokenizer, hf_tok: Any, name: str, add_generation_prompt: bool
) -> None:
    messages = CONVERSATIONS[name]
    text = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    expected_text = hf_tok.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=False
    )
    assert text == expected_text
    ids = tok.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=True
    )
    assert ids == hf_chat(hf_tok, messages, add_generation_prompt=add_generation_prompt)
    assert isinstance(ids, list) and ids[0] == BOS_ID and ids.count(BOS_ID) == 1


def test_chat_template_renders_deepseek_v3_format(tok: Tokenizer) -> None:
    text = tok.apply_chat_template(CONVERSATIONS["tool-round-trip"])
    assert text == (
        "<｜begin▁of▁sentence｜>Use tools when needed.<｜User｜>巴黎天气？"
        "<｜Assistant｜>Let me check.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function"
        '<｜tool▁sep｜>get_weather\n```json\n{"city": "巴黎", "unit": "C"}\n```'
        "<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>"
        "<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>18°C, sunny ☀️<｜tool▁output▁end｜>"
        "<｜tool▁outputs▁end｜>It is 18°C and sunny.<｜end▁of▁sentence｜>"
        "<｜User｜>Thanks! And tomorrow?<｜Assistant｜>"
    )
    # After tool outputs V3's template adds no generation prompt: the model answers on.
    assert tok.apply_chat_template(CONVERSATIONS["tool-calls"]).endswith("<｜tool▁outputs▁end｜>")
    # The reasoning of earlier turns is dropped from the prompt.
    assert "The user greets" not in tok.apply_chat_template(CONVERSATIONS["multi-turn"])


def test_tools_reach_the_template_as_in_transformers(tok: Tokenizer, hf_tok: Any) -> None:
    """V3's own template ignores ``tools``; passing them changes nothing, in both."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    messages = CONVERSATIONS["system"]
    ids = tok.apply_chat_template(messages, tokenize=True, tools=tools)
    assert ids == hf_chat(hf_tok, messages, add_generation_prompt=True, tools=tools)
    assert ids == tok.apply_chat_template(messages, tokenize=True)


GENERATION_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m.role == 'assistant' %}{% generation %}[A:{{ m.thinking }}|{{ m.reasoning_content }}]"
    "{{ m.content }}{{ eos_token }}{% endgeneration %}"
    "{% else %}[{{ m.role }}]{{ m.content }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}[A:{% endif %}"
)
TOOL_USE_TEMPLATE = (
    "{{ bos_token }}[tools]{{ tools | tojson }}{% for m in messages %}"
    "[{{ m.role }}]{{ m.content }}{% endfor %}"
    "{% if not messages[-1].content %}{{ raise_exception('empty last message') }}{% endif %}"
)


def test_template_files_as_transformers_finds_them(
    folder: Path, tmp_path: Path, tok: Tokenizer
) -> None:
    """``chat_template.jinja`` and ``additional_chat_templates/*.jinja`` replace the config's
    template; ``tool_use`` renders requests with tools; ``{% generation %}`` renders its body;
    a reasoning under one name reaches the template under all of them."""
    transformers = pytest.importorskip("transformers")
    write_deepseek_tokenizer(tmp_path)
    (tmp_path / "chat_template.jinja").write_text(GENERATION_TEMPLATE, encoding="utf-8")
    (tmp_path / "additional_chat_templates").mkdir()
    (tmp_path / "additional_chat_templates" / "tool_use.jinja").write_text(
        TOOL_USE_TEMPLATE, encoding="utf-8"
    )
    ours = Tokenizer.from_dir(tmp_path)
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert set(ours.chat_templates) == {"default", "tool_use"}
    messages = [
        {"role": "user", "content": "你好"},
        {"role": "assistant", "content": "嗨 🦩", "reasoning": "greet back"},
        {"role": "user", "content": "tools?"},
    ]
    tools = [{"type": "function", "function": {"name": "f", "description": "<b>&</b>"}}]
    for kwargs in ({}, {"tools": tools}):
        text = ours.apply_chat_template(messages, **kwargs)
        assert text == ref.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False, **kwargs
        )
        assert ours.apply_chat_template(messages, tokenize=True, **kwargs) == hf_chat(
            ref, messages, add_generation_prompt=True, **kwargs
        )
    assert "[A:greet back|greet back]嗨 🦩" in ours.apply_chat_template(messages)
    assert '"<b>&</b>"' in ours.apply_chat_template(messages, tools=tools)  # no HTML escaping
    with pytest.raises(Exception, match="empty last message"):
        ours.apply_chat_template([{"role": "user", "content": ""}], tools=tools)
    assert tok.chat_templates == {"default": tok.chat_template}  # the package's own folder


# --- streaming detokenization -------------------------------------------------------------------

STREAM_TEXT = "前言：🦜鹦鹉和🦩火烈鸟 fly 龘靐齉 𝔘𝔫𝔦 🧑‍🚀 in 北京 ☀️ — done."


def stream(tok: Tokenizer, ids: list[int], sizes: list[int], skip: bool) -> list[str]:
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    pieces, start = [], 0
    for size in sizes:
        pieces.append(detok.push(ids[start : start + size]))
        start += size
    assert start == len(ids)
    pieces.append(detok.flush())
    return pieces


def test_stream_text_splits_characters_across_tokens(tok: Tokenizer) -> None:
    """Guard: the stream text has byte tokens that alone are no character."""
    ids = tok.encode(STREAM_TEXT)
    partial = [i for i in ids if "\ufffd" in tok.decode([i])]
    assert len(partial) >= 10
    assert tok.encode("🦩") == [3574, 102, 105]  # one emoji, three byte tokens


@pytest.mark.parametrize("skip", [True, False])
def test_detokenizer_token_by_token_is_exact(tok: Tokenizer, skip: bool) -> None:
    ids = [BOS_ID, *tok.encode(STREAM_TEXT), *tok.encode(f"{ASSISTANT}尾巴🦩"), EOS_ID]
    pieces = stream(tok, ids, [1] * len(ids), skip)
    assert all("\ufffd" not in piece for piece in pieces)
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=skip)
    expected = f"{STREAM_TEXT}{ASSISTANT}尾巴🦩"
    if not skip:
        expected = f"{tok.bos_token}{expected}{tok.eos_token}"
    assert "".join(pieces) == expected
    assert pieces[-1] == ""  # every character was complete before the end
    # A character's text comes out with the token that completes it, not later.
    emoji = tok.encode("🦩")
    assert stream(tok, emoji, [1, 1, 1], skip) == ["", "", "🦩", ""]


def test_detokenizer_shows_complete_characters_before_a_partial_one(tok: Tokenizer) -> None:
    ids = tok.encode("北京🦜🦩!")
    assert ids == [6127, 3574, 102, 253, 3574, 102, 105, 3]  # 北京, 🦜 (3 bytes), 🦩, !
    detok = IncrementalDetokenizer(tok)
    assert detok.push(ids[:2]) == "北京"  # the chunk ends one byte token into the parrot
    assert detok.push(ids[2:5]) == "🦜"  # ... and this one inside the flamingo
    assert detok.push(ids[5:]) == "🦩!"
    assert detok.flush() == ""


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_detokenizer_random_chunks_is_exact(tok: Tokenizer, seed: int) -> None:
    ids = tok.encode(STREAM_TEXT * 3)
    rng = random.Random(seed)
    sizes: list[int] = []
    while sum(sizes) < len(ids):
        sizes.append(min(rng.randint(0, 5), len(ids) - sum(sizes)))
    pieces = stream(tok, ids, sizes, skip=True)
    assert all("\ufffd" not in piece for piece in pieces)
    assert "".join(pieces) == STREAM_TEXT * 3 == tok.decode(ids)


def test_detokenizer_on_random_ids_equals_decode(tok: Tokenizer) -> None:
    """Ids a random model picks: invalid byte sequences give U+FFFD in decode() too, and the
    stream still equals it exactly."""
    rng = random.Random(7)
    ids = [rng.randrange(tok.vocab_size) for _ in range(400)]
    ids += tok.encode("龘")[:-1]  # ends on half a character: flush returns it as U+FFFD
    for skip in (True, False):
        pieces = stream(tok, ids, [1] * len(ids), skip)
        assert "".join(pieces) == tok.decode(ids, skip_special_tokens=skip)
        assert pieces[-1].endswith("\ufffd")
