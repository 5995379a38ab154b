"""Which request fields the OpenAI routes know, and what an unknown one gets.

OpenAI answers a field it does not know with 400 naming it; so does dsmesh by default
(``--unknown-fields error``). vLLM instead ignores extra fields (with a warning), which is kinder
to clients that send another server's extensions: ``--unknown-fields ignore`` does that. Known
are OpenAI's own fields, the vLLM and SGLang extensions dsmesh implements, and those it
refuses by name (dsmesh/gateway/openai_params.py ``refuse_unsupported``). OpenAI fields with
no effect on the output (``user``, ``metadata``, ``store``, ``service_tier``, ...) are
accepted; those that ask for what a text model here cannot do (``audio``, ``prediction``,
``web_search_options``, ``verbosity``, ``reasoning_effort`` without a reasoning parser) are
400 naming them, as OpenAI answers a model that lacks them.
"""

from __future__ import annotations

import logging
from typing import Any

from dsmesh.gateway.openai_grammar import EXTRA_FIELDS
from dsmesh.gateway.openai_params import OpenAIError, bad_param

log = logging.getLogger(__name__)

UNKNOWN_FIELD_POLICIES = ("error", "ignore")
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")

# OpenAI fields that change nothing here: accepted and not acted on
_NO_EFFECT = frozenset(
    {
        "user",
        "metadata",
        "store",
        "service_tier",
        "safety_identifier",
        "prompt_cache_key",
        "prompt_cache_retention",
    }
)
# vLLM's and SGLang's sampling extensions (docs/GATEWAY.md), and structured outputs'
_EXTENSIONS = frozenset(
    {"top_k", "min_p", "repetition_penalty", "ignore_eos", "min_tokens", "stop_token_ids"}
) | frozenset(EXTRA_FIELDS)
_COMMON = (
    frozenset(
        {
            "model",
            "stream",
            "stream_options",
            "n",
            "temperature",
            "top_p",
            "seed",
            "stop",
            "max_tokens",
            "logprobs",
            "logit_bias",
            "presence_penalty",
            "frequency_penalty",
            "response_format",
            # refused on completions by name (tool calls are chat's)
            "tools",
            "tool_choice",
            "parallel_tool_calls",
            "echo",  # refused on chat by name
        }
    )
    | _NO_EFFECT
    | _EXTENSIONS
)
COMPLETIONS_FIELDS = _COMMON | {"prompt", "best_of", "suffix", "add_special_tokens"}
CHAT_FIELDS = _COMMON | {
    "messages",
    "max_completion_tokens",
    "top_logprobs",
    "functions",  # refused by name: deprecated
    "function_call",
    "reasoning_effort",
    "modalities",
    "audio",
    "prediction",
    "web_search_options",
    "verbosity",
}
_NOT_HERE = ("audio", "prediction", "web_search_options", "verbosity")


def check_fields(body: dict[str, Any], known: frozenset[str], policy: str, route: str = "") -> None:
    """400 naming the first field of ``body`` not in ``known`` (policy ``error``), or a
    warning for each (``ignore``, vLLM's way: the field is then not read)."""
    unknown = [name for name in body if name not in known]
    if not unknown:
        return
    if policy == "ignore":
        log.warning("%s: ignoring unknown fields %s", route or "request", ", ".join(unknown))
        return
    name = unknown[0]
    raise OpenAIError(
        400,
        f"Unrecognized request argument supplied: {name}",
        param=name,
        code="unknown_parameter",
    )


def check_chat_capabilities(body: dict[str, Any], reasoning: bool) -> None:
    """Chat fields a text model here lacks: 400 naming them as OpenAI does for a model without
    them. ``reasoning_effort`` needs a reasoning parser (``--reasoning-parser``); DeepSeek-R1
    reasons at one effort, so any valid level is accepted then."""
    for name in _NOT_HERE:
        if body.get(name) is not None:
            raise _unsupported(name)
    modalities = body.get("modalities")
    if modalities is not None and modalities != ["text"]:
        raise bad_param("modalities", 'only ["text"] is supported')
    effort = body.get("reasoning_effort")
    if effort is None:
        return
    if not reasoning:
        raise _unsupported("reasoning_effort")
    if effort not in REASONING_EFFORTS:
        raise bad_param("reasoning_effort", f"must be one of {', '.join(REASONING_EFFORTS)}")


def _unsupported(name: str) -> OpenAIError:
    return OpenAIError(
        400,
        f"Unsupported parameter: '{name}' is not supported with this model.",
        param=name,
        code="unsupported_parameter",
    )
