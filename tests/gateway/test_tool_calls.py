"""DeepSeek-V3 tool calls parsed from generated text (dsmesh/gateway/tool_calls.py): the format is
the one V3's own chat template renders (round trip through dsmesh/engine/tokenizer.py), and the
result is the same however the text is split into deltas: at every character boundary (so
at every token boundary too), in pairs and triples of pieces, and token by token through
the gateway's detokenizer."""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest

from dsmesh.engine.tokenizer import Tokenizer
from dsmesh.gateway.stop_strings import OutputText
from dsmesh.gateway.tool_calls import (
    CALL_BEGIN,
    CALL_END,
    CALLS_BEGIN,
    CALLS_END,
    SEP,
    TOOL_TOKENS,
    ParsedDelta,
    ToolCall,
    ToolCallParser,
    parse_tool_calls,
)
from tests.engine.deepseek_checkpoint import package_dir

WEATHER = {"city": "巴黎", "unit": "C"}
CLOCK = {"zone": "Europe/Paris"}


def call_text(name: str, arguments: str) -> str:
    return f"{CALL_BEGIN}function{SEP}{name}\n```json\n{arguments}\n```{CALL_END}"


ONE = CALLS_BEGIN + call_text("get_weather", json.dumps(WEATHER)) + CALLS_END
TWO = (
    CALLS_BEGIN
    + call_text("get_weather", json.dumps(WEATHER, ensure_ascii=False))
    + "\n"
    + call_text("get_time", json.dumps(CLOCK))
    + CALLS_END
)

# (output text, content, calls) as a whole output parses.
CASES: list[tuple[str, str, list[ToolCall]]] = [
    ("plain text, no calls <｜tool", "plain text, no calls <｜tool", []),
    (ONE, "", [ToolCall("get_weather", json.dumps(WEATHER))]),
    (
        "Let me check." + TWO,
        "Let me check.",
        [
            ToolCall("get_weather", json.dumps(WEATHER, ensure_ascii=False)),
            ToolCall("get_time", json.dumps(CLOCK)),
        ],
    ),
    # Cut by max_tokens inside the arguments: the call stands with what was written.
    (CALLS_BEGIN + f'{CALL_BEGIN}function{SEP}f\n```json\n{{"a": ', "", [ToolCall("f", '{"a": ')]),
    # The closing fence half written when the output ended: it is argument text.
    (CALLS_BEGIN + f"{CALL_BEGIN}function{SEP}f\n```json\n{{}}\n``", "", [ToolCall("f", "{}\n``")]),
    # A header that never completes is content, its marker included.
    (
        CALLS_BEGIN + f"{CALL_BEGIN}function{SEP}f no fence" + CALLS_END + " tail",
        f"{CALL_BEGIN}function{SEP}f no fence tail",
        [],
    ),
    # A name over two lines is not a name: content again.
    (
        CALLS_BEGIN + call_text("two\nlines", "{}"),
        f"{CALL_BEGIN}function{SEP}two\nlines\n```json\n{{}}\n```{CALL_END}",
        [],
    ),
    # Whitespace between calls and before the section's end is dropped; other text is not.
    (
        CALLS_BEGIN + " \n" + call_text("f", "{}") + "\n\n" + CALLS_END + "\n",
        "\n",
        [ToolCall("f", "{}")],
    ),
    (
        CALLS_BEGIN + call_text("f", "{}") + " note " + call_text("g", "[]") + CALLS_END,
        " note ",
        [ToolCall("f", "{}"), ToolCall("g", "[]")],
    ),
    # A call cut short by the next one's begin marker, or by the section's end.
    (
        CALLS_BEGIN + call_text("f", "{}")[: -len(CALL_END)] + call_text("g", "1") + CALLS_END,
        "",
        [ToolCall("f", "{}"), ToolCall("g", "1")],
    ),
    (CALLS_BEGIN + f"{CALL_BEGIN}function{SEP}f\n```json\n", "", [ToolCall("f", "")]),
    ("  " + CALLS_BEGIN + "   ", "  ", []),
]


def run_pieces(pieces: list[str]) -> tuple[str, list[ToolCall], list[ParsedDelta]]:
    """Feed ``pieces``; the content and the calls as a client reassembles them from deltas."""
    parser = ToolCallParser()
    deltas = [parser.feed(p) for p in pieces] + [parser.finish()]
    names: dict[int, str] = {}
    arguments: dict[int, str] = {}
    for delta in deltas:
        for call in delta.calls:
            if call.name is not None:
                assert call.index not in names and call.index == len(names)
                names[call.index], arguments[call.index] = call.name, ""
            arguments[call.index] += call.arguments
    calls = [ToolCall(names[i], arguments[i]) for i in sorted(names)]
    assert calls == parser.calls
    return "".join(d.content for d in deltas), calls, deltas


@pytest.mark.parametrize("case", range(len(CASES)))
def test_whole_output(case: int) -> None:
    text, content, calls = CASES[case]
    assert parse_tool_calls(text) == (content, calls)
    assert run_pieces([text])[:2] == (content, calls)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_split_at_every_boundary(case: int) -> None:
    text, content, calls = CASES[case]
    for cut in range(len(text) + 1):
        assert run_pieces([text[:cut], text[cut:]])[:2] == (content, calls), cut
    assert run_pieces(list(text))[:2] == (content, calls)  # one character at a time


def test_split_in_three_everywhere() -> None:
    text, content, calls = CASES[2]
    for a, b in itertools.combinations(range(len(text) + 1), 2):
        assert run_pieces([text[:a], text[a:b], text[b:]])[:2] == (content, calls), (a, b)


def test_name_comes_first_then_argument_fragments() -> None:
    text = CALLS_BEGIN + call_text("get_weather", '{"city": "Paris"}') + CALLS_END
    _, calls, deltas = run_pieces(list(text))
    call_deltas = [c for d in deltas for c in d.calls]
    assert call_deltas[0].name == "get_weather" and call_deltas[0].arguments == ""
    assert all(c.name is None for c in call_deltas[1:])
    assert len(call_deltas) > 5  # the arguments stream as they come, not in one piece
    assert calls == [ToolCall("get_weather", '{"city": "Paris"}')]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_dir(package_dir())


def assistant_turns(tok: Tokenizer, messages: list[dict[str, Any]]) -> str:
    """What V3's template renders for the conversation's first assistant turn, as the model
    would write it: after ``<｜Assistant｜>``, before ``<｜end▁of▁sentence｜>``."""
    text = tok.apply_chat_template(messages, add_generation_prompt=False)
    assert isinstance(text, str)
    return text.split("<｜Assistant｜>", 1)[1].split(tok.eos_token or "", 1)[0]


def test_round_trip_through_v3_template(tok: Tokenizer) -> None:
    """Calls rendered by DeepSeek-V3's own template parse back to the same calls."""
    tool_calls = [
        {
            "id": f"call_{i}",
            "type": "function",
            "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)},
        }
        for i, (name, args) in enumerate((("get_weather", WEATHER), ("get_time", CLOCK)))
    ]
    for content in ("", "Let me look. "):
        messages = [
            {"role": "user", "content": "巴黎天气？"},
            {"role": "assistant", "content": content, "tool_calls": tool_calls},
        ]
        written = assistant_turns(tok, messages)
        expected = [ToolCall(c["function"]["name"], c["function"]["arguments"]) for c in tool_calls]
        assert parse_tool_calls(written) == (content, expected)


def test_token_by_token_through_the_detokenizer(tok: Tokenizer) -> None:
    """The markers are single added tokens that ``skip_special_tokens`` keeps (they are not
    ``special`` in V3's tokenizer); fed token by token through the gateway's output text,
    the calls come out whole."""
    for marker in TOOL_TOKENS:
        ids = tok.encode(marker, add_special_tokens=False)
        assert len(ids) == 1 and tok.decode(ids, skip_special_tokens=True) == marker
    text = "好的。" + TWO
    ids = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id or 0]
    output = OutputText(tok, ())
    pieces = [output.push([i]) for i in ids] + [output.finish()]
    assert "".join(pieces) == text
    assert run_pieces(pieces)[:2] == parse_tool_calls(text)
    assert parse_tool_calls(text)[0] == "好的。" and len(parse_tool_calls(text)[1]) == 2
