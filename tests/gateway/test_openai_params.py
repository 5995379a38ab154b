"""The OpenAI routes' request fields, in process: penalties, logit_bias, logprobs and n map
onto the engine's sampling; what the gateway cannot do yet is a 400 naming the field."""

from __future__ import annotations

from typing import Any

import pytest

from dsmesh.engine.sampling.params import SamplingParams
from dsmesh.gateway.openai_api import OpenAIRoutes, served_model_names
from dsmesh.gateway.openai_params import (
    OpenAIError,
    include_usage,
    num_choices,
    prompt_only,
    sampling_from_openai,
)


def chat(body: dict[str, Any]) -> SamplingParams:
    return sampling_from_openai(body, 100, "max_completion_tokens", chat=True)


def test_penalties_and_logit_bias() -> None:
    params = sampling_from_openai(
        {
            "presence_penalty": 0.5,
            "frequency_penalty": -1,
            "repetition_penalty": 1.2,
            "logit_bias": {"50": -100, "7": 2.5},
        },
        10,
    )
    assert (params.presence_penalty, params.frequency_penalty) == (0.5, -1.0)
    assert params.repetition_penalty == 1.2
    assert params.logit_bias == ((7, 2.5), (50, -100.0))
    assert sampling_from_openai({}, 10).adjusts_logits is False


def test_logprobs_fields() -> None:
    assert sampling_from_openai({"logprobs": 3}, 10).logprobs == 3
    assert sampling_from_openai({"logprobs": 0}, 10).logprobs == 0
    assert sampling_from_openai({"logprobs": None}, 10).logprobs is None
    assert sampling_from_openai({"logprobs": False}, 10).logprobs is None
    assert chat({"logprobs": True, "top_logprobs": 5}).logprobs == 5
    assert chat({"logprobs": True}).logprobs == 0
    assert chat({"logprobs": False}).logprobs is None
    assert chat({}).logprobs is None


def test_choices() -> None:
    assert num_choices({}) == 1
    assert num_choices({"n": 3}) == 3
    assert num_choices({"n": 2, "best_of": 2}) == 2
    assert num_choices({"best_of": 1}) == 1  # as SGLang's bench_serving sends it


BAD_COMPLETIONS = [
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": "high"}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"5": "1"}}, "logit_bias"),
    ({"logit_bias": [1, 2]}, "logit_bias"),
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": True}, "logprobs"),
    ({"echo": "yes"}, "echo"),
    ({"min_tokens": 3, "max_tokens": 2}, "min_tokens"),
    ({"min_tokens": 1, "max_tokens": 0}, "min_tokens"),  # the prompt only
    ({"stop_token_ids": [1, "2"]}, "stop_token_ids"),
    ({"suffix": "x"}, "suffix"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),  # chat only
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"guided_regex": "(ab"}, "guided_regex"),
    ({"guided_json": {"type": "objectx"}}, "guided_json"),
    ({"guided_choice": "yes"}, "guided_choice"),
    ({"regex": "a+", "ebnf": 'root ::= "a"'}, "ebnf"),  # one constraint at a time
]


@pytest.mark.parametrize(("extra", "param"), BAD_COMPLETIONS)
def test_bad_completions_fields_name_the_param(extra: dict[str, Any], param: str) -> None:
    with pytest.raises(OpenAIError) as info:
        sampling_from_openai(extra, 10)
    assert info.value.status == 400 and info.value.param == param
    assert info.value.message.startswith(f"{param}: ")


TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
BAD_CHAT = [
    ({"top_logprobs": 2}, "top_logprobs"),  # needs logprobs: true
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"logprobs": 3}, "logprobs"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"function_call": "auto"}, "function_call"),
    ({"echo": True}, "echo"),  # completions' only
    (
        {"response_format": {"type": "json_schema", "json_schema": {}}},
        "response_format.json_schema.name",
    ),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": []}}},
        "response_format.json_schema.schema",
    ),
]


@pytest.mark.parametrize(("extra", "param"), BAD_CHAT)
def test_bad_chat_fields_name_the_param(extra: dict[str, Any], param: str) -> None:
    with pytest.raises(OpenAIError) as info:
        chat(extra)
    assert info.value.status == 400 and info.value.param == param


def test_tools_with_tool_choice_none_and_text_format_are_accepted() -> None:
    chat({"tools": TOOLS, "tool_choice": "none", "response_format": {"type": "text"}})


@pytest.mark.parametrize(
    ("body", "param"),
    [({"n": 0}, "n"), ({"n": 129}, "n"), ({"n": 2, "best_of": 3}, "best_of"), ({"n": "2"}, "n")],
)
def test_bad_choices_name_the_param(body: dict[str, Any], param: str) -> None:
    with pytest.raises(OpenAIError) as info:
        num_choices(body)
    assert info.value.param == param


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"max_tokens": 0}, "max_tokens"),  # chat's older field, as the client sent it
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"max_tokens": "8"}, "max_tokens"),
        ({"max_tokens": 8, "max_completion_tokens": -1}, "max_completion_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"min_p": 1}, "min_p"),
        ({"seed": -1}, "seed"),
        ({"presence_penalty": 3}, "presence_penalty"),
    ],
)
def test_chat_sampling_errors_name_the_field_sent(body: dict[str, Any], param: str) -> None:
    with pytest.raises(OpenAIError) as info:
        chat(body)
    assert info.value.status == 400 and info.value.param == param
    assert info.value.message.startswith(f"{param}: ")
    assert "max_new_tokens" not in info.value.message


def test_completions_max_tokens_error_names_max_tokens() -> None:
    with pytest.raises(OpenAIError) as info:
        sampling_from_openai({"max_tokens": -1}, 10)
    assert info.value.message == "max_tokens: must be in [1, 2**31 - 1], got -1"


def test_stream_options() -> None:
    assert include_usage({"stream": True, "stream_options": {"include_usage": True}})
    assert not include_usage({"stream": True, "stream_options": {"include_usage": False}})
    assert not include_usage({"stream": True, "stream_options": {}})
    assert not include_usage({"stream": False})
    assert not include_usage({"stream_options": None})


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"stream_options": {"include_usage": True}}, "stream_options"),  # no stream
        ({"stream": False, "stream_options": {}}, "stream_options"),
        ({"stream": True, "stream_options": [1]}, "stream_options"),
        ({"stream": True, "stream_options": {"continuous_usage_stats": True}},
         "stream_options.continuous_usage_stats"),
        ({"stream": True, "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
    ],
)  # fmt: skip
def test_bad_stream_options_name_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(OpenAIError) as info:
        include_usage(body)
    assert info.value.status == 400 and info.value.param == param
    assert info.value.message.startswith(f"{param}: ")


def test_served_model_names() -> None:
    assert served_model_names("a") == ("a",)
    assert served_model_names("a, b,,a") == ("a", "b")
    assert served_model_names(["a,b", "c", "b"]) == ("a", "b", "c")
    assert served_model_names(["", " "]) == ()
    with pytest.raises(ValueError):
        OpenAIRoutes(None, "")  # type: ignore[arg-type]
    routes = OpenAIRoutes(None, ["deepseek-v3", "ds3,default"])  # type: ignore[arg-type]
    assert routes.model_name == "deepseek-v3"
    assert routes.model_names == ("deepseek-v3", "ds3", "default")


def test_min_tokens_stop_token_ids_echo_and_the_prompt_only() -> None:
    """vLLM's extra fields map onto SamplingParams; completions' echo with logprobs scores the
    prompt; max_tokens 0 asks the instance for 1 token (dropped by the gateway)."""
    params = sampling_from_openai({"min_tokens": 2, "stop_token_ids": [7, 9]}, 10)
    assert (params.min_tokens, params.stop_token_ids, params.prompt_logprobs) == (2, (7, 9), None)
    scoring = {"max_tokens": 0, "echo": True, "logprobs": 1}
    assert prompt_only(scoring, chat=False) and not prompt_only(scoring, chat=True)
    params = sampling_from_openai(scoring, 10)
    assert (params.max_new_tokens, params.logprobs, params.prompt_logprobs) == (1, 1, 1)
    assert sampling_from_openai({"echo": True}, 10).prompt_logprobs is None  # no logprobs
    assert not prompt_only({"max_tokens": False}, chat=False)
