"""OpenAI's Responses API through a running mesh (`dsmesh up` with its default model), called
by the real openai SDK (``client.responses.create`` and ``client.responses.stream``): text,
function tools, ``text.format`` json_schema, ``previous_response_id``; responses and every
streamed event validate against the SDK's own models (tests/gateway/openai_conformance.py)."""

from __future__ import annotations

import json
import urllib.request

import openai
import pytest
from openai.types.responses import Response
from openai.types.responses.response_stream_event import ResponseStreamEvent
from pydantic import TypeAdapter

from dsmesh.engine.tokenizer import Tokenizer
from tests.gateway.openai_conformance import conform

pytestmark = pytest.mark.timeout(300)

TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather of a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 8}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
}
SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["n"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def client(gw) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def tok(gw) -> Tokenizer:
    return Tokenizer.from_dir(gw.model_dir)


def test_text_response_is_the_chat_completion(gw, client) -> None:
    """A response runs as the chat request it maps onto: the same greedy text and usage."""
    kw = dict(model=gw.model_name, temperature=0)
    resp = client.responses.create(
        input="Hi there", instructions="Be brief.", max_output_tokens=6, **kw
    )
    chat = client.chat.completions.create(
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi there"},
        ],
        max_completion_tokens=6,
        **kw,
    )
    assert resp.output_text == chat.choices[0].message.content
    assert resp.usage.input_tokens == chat.usage.prompt_tokens
    assert resp.usage.output_tokens == chat.usage.completion_tokens == 6
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    with urllib.request.urlopen(f"{gw.url}/v1/responses/{resp.id}", timeout=10) as got:
        stored = json.loads(got.read())  # the same object, as sent
    assert conform(Response, stored) == resp


def test_function_call_and_its_output_in_a_follow_up(gw, client) -> None:
    first = client.responses.create(
        model=gw.model_name,
        input="Weather in Paris?",
        tools=[TOOL],
        tool_choice="required",
        parallel_tool_calls=False,  # one call, then the grammar ends the output
        max_output_tokens=40,
    )
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather"
    assert set(json.loads(calls[0].arguments)) == {"city"}
    assert first.status == "completed"
    # the follow-up sends only the tool's output; the conversation comes from the first
    second = client.responses.create(
        model=gw.model_name,
        previous_response_id=first.id,
        input=[
            {"type": "function_call_output", "call_id": calls[0].call_id, "output": '{"c": 21}'}
        ],
        tools=[TOOL],
        max_output_tokens=4,
        temperature=0,
    )
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    # the same conversation sent in full gives the same prompt
    full = client.responses.create(
        model=gw.model_name,
        input=[
            {"role": "user", "content": "Weather in Paris?"},
            *[c.model_dump(include={"type", "call_id", "name", "arguments"}) for c in calls],
            {"type": "function_call_output", "call_id": calls[0].call_id, "output": '{"c": 21}'},
        ],
        tools=[TOOL],
        max_output_tokens=4,
        temperature=0,
    )
    assert full.usage.input_tokens == second.usage.input_tokens
    assert full.output_text == second.output_text


def test_json_schema_format(gw, client) -> None:
    resp = client.responses.create(
        model=gw.model_name,
        input="A number as JSON",
        text={"format": {"type": "json_schema", "name": "n", "schema": SCHEMA, "strict": True}},
        max_output_tokens=20,
    )
    assert 0 <= json.loads(resp.output_text)["n"] <= 99


def test_stream_events_follow_openai(gw, client) -> None:
    """``client.responses.stream`` accumulates the events into the final response; every
    event validates against the SDK's event models."""
    with client.responses.stream(
        model=gw.model_name,
        input="Weather in Paris?",
        tools=[TOOL],
        tool_choice="required",
        parallel_tool_calls=False,  # one call, then the grammar ends the output
        max_output_tokens=40,
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    adapter = TypeAdapter(ResponseStreamEvent)
    for event in events:
        adapter.validate_python(event.model_dump(mode="json", exclude_unset=True), strict=True)
    arguments = "".join(
        e.delta for e in events if e.type == "response.function_call_arguments.delta"
    )
    [call] = [item for item in final.output if item.type == "function_call"]
    assert call.arguments == arguments and json.loads(arguments)["city"]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert final.output_text == text


def test_stream_of_text_matches_the_whole(gw, client) -> None:
    kw = dict(model=gw.model_name, input="Hello", max_output_tokens=8, temperature=0)
    whole = client.responses.create(**kw)
    assert whole.status == "incomplete"  # max_output_tokens ended it
    with client.responses.stream(**kw) as stream:
        events = list(stream)
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    # as OpenAI ends a response cut by max_output_tokens (no response.completed)
    assert events[-1].type == "response.incomplete"
    final = events[-1].response
    assert final.incomplete_details.reason == "max_output_tokens"
    assert "".join(deltas) == final.output_text == whole.output_text


@pytest.mark.parametrize(
    "extra,param,code",
    [
        ({"bogus": 1}, "bogus", "unknown_parameter"),
        ({"max_output_tokens": 0}, "max_output_tokens", None),
        (
            {"previous_response_id": "resp_nope"},
            "previous_response_id",
            "previous_response_not_found",
        ),
        ({"reasoning": {"effort": "low"}}, "reasoning.effort", "unsupported_parameter"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type", None),
        ({"input": [{"type": "input_image"}]}, "input[0].type", None),
        ({"temperature": 3}, "temperature", None),
    ],
)
def test_bad_input_is_400_naming_the_field(gw, client, extra, param, code) -> None:
    body = {"input": "Hi", **extra}
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=gw.model_name, **body) if "bogus" not in body else (
            client.responses.create(model=gw.model_name, input="Hi", extra_body={"bogus": 1})
        )
    assert info.value.param == param and info.value.code == code


# ---- reasoning items: the default model behind a gateway with --reasoning-parser ----------


@pytest.fixture(scope="module")
def r1_client(tmp_path_factory: pytest.TempPathFactory):
    from dsmesh.engine.model.tiny_model import default_model_dir
    from tests.mesh import one_unified, running_gateway_mesh

    cache = tmp_path_factory.mktemp("r1-cache")
    model = default_model_dir(cache_dir=cache, tokenizer="deepseek-v3")
    logs = tmp_path_factory.mktemp("r1-logs")
    instances = one_unified(model, "--max-total-tokens", "4096")
    parser = ("--reasoning-parser", "deepseek-r1")
    with running_gateway_mesh(None, logs, instances, parser, model=model) as (_, port, _):
        url = f"http://127.0.0.1:{port}/v1"
        yield openai.OpenAI(base_url=url, api_key="unused", max_retries=0), model.name


# R1's template opens <think> in the prompt, so output with no </think> is all reasoning
# (dsmesh/gateway/reasoning.py); a grammar makes random weights write four letters and end
THINKING = {"guided_regex": "[a-z]{4}"}


def test_reasoning_items(r1_client) -> None:
    client, model = r1_client
    kw = dict(model=model, input="2+2?", max_output_tokens=30, reasoning={"effort": "low"})
    resp = client.responses.create(**kw, extra_body=THINKING)
    assert [item.type for item in resp.output] == ["reasoning"]  # no answer after it
    [thought] = resp.output[0].content
    assert thought.type == "reasoning_text" and len(thought.text) == 4
    assert resp.output_text == "" and resp.status == "completed"
    assert resp.reasoning.effort == "low"
    reasoning_tokens = resp.usage.output_tokens_details.reasoning_tokens
    assert 1 <= reasoning_tokens <= resp.usage.output_tokens
    with client.responses.stream(**kw, extra_body=THINKING) as stream:
        events = list(stream)
        final = stream.get_final_response()
    thinking = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert thinking == final.output[0].content[0].text
    assert len(thinking) == 4 and final.output_text == ""
    done = [e.item.type for e in events if e.type == "response.output_item.done"]
    assert done == ["reasoning"]
    adapter = TypeAdapter(ResponseStreamEvent)
    for event in events:
        adapter.validate_python(event.model_dump(mode="json", exclude_unset=True), strict=True)
