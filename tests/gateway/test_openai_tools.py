"""The chat route's tools and tool_choice (dsmesh/gateway/openai_tools.py): 400s naming the field,
the choice's defaults, and the grammar of enforced calls checked with llguidance against
DeepSeek-V3's real tokenizer: it accepts exactly what V3's chat template writes for a call,
token for token, and random logits masked by it always give calls whose arguments follow
the function's schema."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
import torch

from dsmesh.engine.sampling.grammar import GrammarSpec, GrammarVocab, bitmask_words
from dsmesh.engine.sampling.params import SamplingParams
from dsmesh.engine.tokenizer import Tokenizer, write_byte_level_tokenizer
from dsmesh.gateway.openai_params import OpenAIError
from dsmesh.gateway.openai_tools import (
    ToolRequest,
    apply_tool_choice,
    tool_call_grammar,
    tool_request,
)
from dsmesh.gateway.tool_calls import CALL_END, ToolCall, parse_tool_calls
from tests.engine.deepseek_checkpoint import EOS_ID, VOCAB_SIZE, package_dir

WEATHER_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "unit": {"enum": ["C", "F"]},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TIME_SCHEMA = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC", "Europe/Paris"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER_SCHEMA},
    },
    {"type": "function", "function": {"name": "get_time", "parameters": TIME_SCHEMA}},
    {"type": "function", "function": {"name": "ping"}},  # no parameters: takes none
]


def check_arguments(name: str, arguments: str) -> None:
    """``arguments`` is JSON that follows the schema of ``name`` (asserted field by field)."""
    args = json.loads(arguments)
    assert isinstance(args, dict)
    if name == "get_weather":
        assert set(args) <= {"city", "days", "unit"} and {"city", "days"} <= set(args)
        assert isinstance(args["city"], str) and len(args["city"]) <= 12
        assert type(args["days"]) is int and 1 <= args["days"] <= 14
        assert args.get("unit", "C") in ("C", "F")
    elif name == "get_time":
        assert set(args) == {"zone"} and args["zone"] in ("UTC", "Europe/Paris")
    else:
        assert name == "ping" and args == {}


NAMED = {"type": "function", "function": {"name": "get_time"}}
BAD = [
    ({"tools": {"type": "function"}}, "tools"),
    ({"tools": [1]}, "tools[0]"),
    ({"tools": [{"type": "custom", "custom": {}}]}, "tools[0].type"),
    ({"tools": [{"type": "function"}]}, "tools[0].function"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "x" * 65}}]}, "tools[0].function.name"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools[1].function.name"),
    (
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
        "tools[0].function.parameters",
    ),
    (
        {"tools": [{"type": "function", "function": {"name": "f", "args": {}}}]},
        "tools[0].function.args",
    ),
    (
        {"tools": [{"type": "function", "function": {"name": "f", "strict": "yes"}}]},
        "tools[0].function.strict",
    ),
    ({"tools": TOOLS, "tool_choice": "any"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": 1}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "allowed_tools"}}, "tool_choice.type"),
    ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice.function.name"),
    (
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "tool_choice.function.name",
    ),
    ({"tool_choice": NAMED}, "tool_choice.function.name"),  # no tools to name
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "parallel_tool_calls": "no"}, "parallel_tool_calls"),
]


@pytest.mark.parametrize(("body", "param"), BAD)
def test_bad_tools_name_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(OpenAIError) as info:
        tool_request(body)
    assert info.value.status == 400 and info.value.param == param
    assert info.value.message.startswith(f"{param}: ")


def test_choices_and_defaults() -> None:
    assert tool_request({}) == ToolRequest((), "none")
    assert not tool_request({"tool_choice": "auto"}).parses  # nothing to call
    auto = tool_request({"tools": TOOLS})
    assert (auto.choice, auto.parses, auto.enforced, auto.parallel) == ("auto", True, False, True)
    assert auto.template_tools == TOOLS
    none = tool_request({"tools": TOOLS, "tool_choice": "none"})
    assert not none.parses and none.template_tools == TOOLS  # shown to the template only
    named = tool_request({"tools": TOOLS, "tool_choice": NAMED, "parallel_tool_calls": False})
    assert (named.choice, named.function, named.enforced, named.parallel) == (
        "function",
        "get_time",
        True,
        False,
    )


def test_a_schema_llguidance_refuses_names_its_tool() -> None:
    tools = [
        *TOOLS,
        {
            "type": "function",
            "function": {
                "name": "bad",
                "parameters": {
                    "type": "object",
                    "properties": {"x": {"type": "string", "pattern": "(?<=a)b"}},
                },
            },
        },
    ]
    with pytest.raises(OpenAIError) as info:
        tool_call_grammar(tool_request({"tools": tools, "tool_choice": "required"}))
    assert info.value.param == "tools[3].function.parameters"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_dir(package_dir())


@pytest.fixture(scope="module")
def vocab() -> GrammarVocab:
    return GrammarVocab.from_checkpoint(package_dir(), VOCAB_SIZE, [EOS_ID])


def test_apply_tool_choice(tok: Tokenizer, tmp_path: Any) -> None:
    params = SamplingParams(max_new_tokens=8, stop_token_ids=(5,))
    none = tool_request({"tools": TOOLS, "tool_choice": "none"})
    assert apply_tool_choice(params, none, tok) == params
    auto = tool_request({"tools": TOOLS})
    assert apply_tool_choice(params, auto, tok) == params
    single = tool_request({"tools": TOOLS, "parallel_tool_calls": False})
    call_end = tok.encode(CALL_END, add_special_tokens=False)
    assert apply_tool_choice(params, single, tok).stop_token_ids == (5, *call_end)
    required = tool_request({"tools": TOOLS, "tool_choice": "required"})
    assert apply_tool_choice(params, required, tok).grammar == tool_call_grammar(required)
    with pytest.raises(OpenAIError) as info:  # two grammars cannot both hold
        apply_tool_choice(SamplingParams(grammar=GrammarSpec.json_object()), required, tok)
    assert info.value.param == "tool_choice"
    write_byte_level_tokenizer(tmp_path / "tiny")  # a tokenizer without V3's tool-call tokens
    with pytest.raises(OpenAIError) as info:
        apply_tool_choice(params, required, Tokenizer.from_dir(tmp_path / "tiny"))
    assert info.value.param == "tool_choice"
    # V3's tokenizer with the tool-call tokens marked special: the text would drop them.
    special = json.loads((package_dir() / "tokenizer.json").read_text(encoding="utf-8"))
    for added in special["added_tokens"]:
        added["special"] = added["special"] or "tool" in added["content"]
    (tmp_path / "special").mkdir()
    (tmp_path / "special" / "tokenizer.json").write_text(json.dumps(special), encoding="utf-8")
    with pytest.raises(OpenAIError) as info:
        apply_tool_choice(params, required, Tokenizer.from_dir(tmp_path / "special"))
    assert info.value.param == "tool_choice" and "special" in info.value.message


def template_calls(tok: Tokenizer, calls: list[tuple[str, dict[str, Any]]]) -> list[int]:
    """The ids V3's template writes for an assistant turn of ``calls``, up to EOS."""
    tool_calls = [
        {"type": "function", "function": {"name": n, "arguments": json.dumps(a)}} for n, a in calls
    ]
    messages = [
        {"role": "user", "content": "?"},
        {"role": "assistant", "content": "", "tool_calls": tool_calls},
    ]
    ids = tok.apply_chat_template(messages, add_generation_prompt=False, tokenize=True)
    assert isinstance(ids, list)
    start = ids.index(tok.encode("<｜Assistant｜>", add_special_tokens=False)[0]) + 1
    return ids[start : ids.index(EOS_ID, start)]


def accepts(vocab: GrammarVocab, spec: GrammarSpec, ids: list[int]) -> bool:
    """Whether the grammar takes ``ids`` and is then complete."""
    matcher = vocab.matcher(spec)
    return all(matcher.accept(t) for t in ids) and matcher.is_terminated


def test_grammar_accepts_what_the_template_writes(tok: Tokenizer, vocab: GrammarVocab) -> None:
    weather = ("get_weather", {"city": "Paris", "days": 3})
    clock = ("get_time", {"zone": "UTC"})
    required = tool_call_grammar(tool_request({"tools": TOOLS, "tool_choice": "required"}))
    single = tool_call_grammar(
        tool_request({"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False})
    )
    named = tool_call_grammar(tool_request({"tools": TOOLS, "tool_choice": NAMED}))
    assert accepts(vocab, required, template_calls(tok, [weather]))
    assert accepts(vocab, required, template_calls(tok, [weather, clock, ("ping", {})]))
    assert accepts(vocab, single, template_calls(tok, [clock]))
    assert not accepts(vocab, single, template_calls(tok, [weather, clock]))
    assert accepts(vocab, named, template_calls(tok, [clock]))
    assert not accepts(vocab, named, template_calls(tok, [weather]))  # another function
    assert not accepts(vocab, named, template_calls(tok, [("get_time", {"zone": "Mars"})]))
    assert not accepts(vocab, required, template_calls(tok, [("get_weather", {"days": 3})]))
    # The markers are the added tokens: their text spelt in pieces is refused.
    spelt = tok.encode("<｜", add_special_tokens=False)
    matcher = vocab.matcher(required)
    assert not matcher.accept(spelt[0])


def sample_masked(vocab: GrammarVocab, spec: GrammarSpec, seed: int, limit: int) -> list[int]:
    """Random logits (as random weights give), masked by the grammar, sampled until EOS, the
    grammar's end, or ``limit`` tokens."""
    gen = torch.Generator().manual_seed(seed)
    matcher = vocab.matcher(spec)
    row = np.zeros(bitmask_words(VOCAB_SIZE), dtype=np.int32)
    ids: list[int] = []
    while len(ids) < limit and not matcher.is_terminated:
        matcher.fill_bitmask(row)
        allowed = np.unpackbits(row.view(np.uint8), bitorder="little")[:VOCAB_SIZE]
        logits = torch.randn(VOCAB_SIZE, generator=gen) * 4
        logits[~torch.from_numpy(allowed.astype(bool))] = -float("inf")
        token = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))
        ids.append(token)
        assert matcher.accept(token), matcher.error
    return ids


@pytest.mark.parametrize("seed", range(4))
def test_random_logits_under_the_grammar_give_valid_calls(
    tok: Tokenizer, vocab: GrammarVocab, seed: int
) -> None:
    for body, names, many in [
        ({"tool_choice": "required"}, {"get_weather", "get_time", "ping"}, True),
        ({"tool_choice": "required", "parallel_tool_calls": False}, None, False),
        ({"tool_choice": NAMED}, {"get_time"}, False),
    ]:
        spec = tool_call_grammar(tool_request({"tools": TOOLS, **body}))
        ids = sample_masked(vocab, spec, seed, 400)
        content, calls = parse_tool_calls(tok.decode(ids, skip_special_tokens=True))
        assert content == "" and calls and (many or len(calls) == 1), calls
        for call in calls:
            assert names is None or call.name in names
            check_arguments(call.name, call.arguments)
        assert isinstance(calls[0], ToolCall)
