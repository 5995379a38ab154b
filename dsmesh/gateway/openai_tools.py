"""The chat route's ``tools``, ``tool_choice`` and ``parallel_tool_calls``, checked, and what
they ask of generation.

- ``tool_choice: "none"``: the tools reach the chat template; the output is not parsed.
- ``"auto"`` (the default with tools): the output is parsed into ``tool_calls``
  (dsmesh/gateway/tool_calls.py) when the model writes calls.
- ``"required"``, or a named function (``{"type": "function", "function": {"name": ...}}``):
  a grammar (dsmesh/engine/sampling/grammar.py) makes the output one or more calls in DeepSeek-V3's
  format (exactly one of the named function), each call's arguments JSON that follows the
  function's ``parameters`` schema, so even random weights yield a valid call.
- ``parallel_tool_calls: false``: at most one call. Enforced calls: the grammar allows one;
  ``"auto"``: generation stops at the first call's ``<｜tool▁call▁end｜>`` token.

Errors are 400s naming the field as the client sent it (``tools[1].function.name``).
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from typing import Any

from dsmesh.engine.errors import InvalidRequestError
from dsmesh.engine.sampling.grammar import JSON_OPTIONS, GrammarSpec, lark_literal
from dsmesh.engine.sampling.params import SamplingParams
from dsmesh.engine.tokenizer import Tokenizer
from dsmesh.gateway.openai_params import bad_param
from dsmesh.gateway.tool_calls import (
    ARGS_CLOSE,
    ARGS_OPEN,
    CALL_BEGIN,
    CALL_END,
    CALLS_BEGIN,
    CALLS_END,
    SEP,
    TOOL_TOKENS,
)

TOOL_CHOICES = ("none", "auto", "required")
_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # OpenAI's rule for function names
_FUNCTION_KEYS = frozenset({"name", "description", "parameters", "strict"})
# OpenAI's meaning of omitted parameters: the function takes none.
_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(frozen=True)
class ToolRequest:
    """A chat request's tools as the chat template gets them, and its choice: ``choice`` is
    ``"none"``, ``"auto"``, ``"required"`` or ``"function"`` (then ``function`` names it)."""

    tools: tuple[dict[str, Any], ...]
    choice: str
    function: str | None = None
    parallel: bool = True

    @property
    def parses(self) -> bool:
        """Whether the output is parsed into ``tool_calls``."""
        return self.choice != "none" and bool(self.tools)

    @property
    def enforced(self) -> bool:
        """Whether a grammar makes the output a call."""
        return self.choice in ("required", "function")

    @property
    def template_tools(self) -> list[dict[str, Any]] | None:
        """What the chat template's ``tools`` gets (None without tools, as transformers)."""
        return list(self.tools) if self.tools else None

    def parameters(self, name: str) -> dict[str, Any]:
        """The JSON schema of function ``name``'s arguments."""
        for tool in self.tools:
            function = tool["function"]
            if function["name"] == name:
                return function.get("parameters") or _NO_PARAMETERS
        raise KeyError(name)


def tool_request(body: dict[str, Any]) -> ToolRequest:
    """``tools``, ``tool_choice`` and ``parallel_tool_calls`` of a chat body, checked."""
    tools = _tools(body.get("tools"))
    names = [t["function"]["name"] for t in tools]
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad_param("parallel_tool_calls", "must be a boolean")
    choice = body.get("tool_choice")
    function = None
    if choice is None:
        choice = "auto" if tools else "none"
    elif isinstance(choice, str):
        if choice not in TOOL_CHOICES:
            raise bad_param("tool_choice", f"must be one of {TOOL_CHOICES} or a named function")
    elif isinstance(choice, dict):
        if choice.get("type") != "function":
            raise bad_param("tool_choice.type", 'only "function" is supported')
        named = choice.get("function")
        if not isinstance(named, dict) or not isinstance(named.get("name"), str):
            raise bad_param("tool_choice.function.name", "is required and must be a string")
        function = named["name"]
        if function not in names:
            raise bad_param("tool_choice.function.name", f"{function!r} is not a function in tools")
        choice = "function"
    else:
        raise bad_param("tool_choice", "must be a string or an object")
    if choice == "required" and not tools:
        raise bad_param("tool_choice", '"required" needs tools')
    return ToolRequest(tuple(tools), choice, function, True if parallel is None else parallel)


def _tools(tools: Any) -> list[dict[str, Any]]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise bad_param("tools", "must be a list of tools")
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise bad_param(where, "must be an object")
        if tool.get("type") != "function":
            raise bad_param(f"{where}.type", 'only "function" tools are supported')
        function = tool.get("function")
        if not isinstance(function, dict):
            raise bad_param(f"{where}.function", "is required and must be an object")
        for key in function:
            if key not in _FUNCTION_KEYS:
                raise bad_param(f"{where}.function.{key}", "unknown field")
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise bad_param(
                f"{where}.function.name", "must be 1-64 characters of a-z, A-Z, 0-9, _ and -"
            )
        if name in seen:
            raise bad_param(f"{where}.function.name", f"{name!r} is defined twice")
        seen.add(name)
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise bad_param(f"{where}.function.description", "must be a string")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise bad_param(f"{where}.function.parameters", "must be a JSON Schema object")
        strict = function.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise bad_param(f"{where}.function.strict", "must be a boolean")
    return tools


def tool_call_grammar(request: ToolRequest) -> GrammarSpec:
    """The grammar of an enforced choice: DeepSeek-V3's calls section (as its chat template
    writes one) of one call to ``request.function``, or of one or more calls (one when not
    ``parallel``) to any of the tools; each call's arguments are compact JSON following the
    function's ``parameters``. The markers are the tokenizer's single added tokens (bare in
    llguidance's Lark), never text that spells them. Raises the 400 naming the tool whose
    ``parameters`` llguidance cannot compile."""
    names = [request.function] if request.choice == "function" else _names(request)
    rules = []
    for i, name in enumerate(names):
        schema = request.parameters(name)  # type: ignore[arg-type]
        _check_schema(request, name, schema)
        options = {"x-guidance": JSON_OPTIONS}  # compact JSON: no padding with whitespace
        header = lark_literal(f"{name}{ARGS_OPEN}")
        rules.append(
            f"call_{i}: {CALL_BEGIN} {lark_literal('function')} {SEP} {header} args_{i} "
            f"{lark_literal(ARGS_CLOSE)} {CALL_END}\n"
            f"args_{i}: %json {json.dumps({**schema, **options}, ensure_ascii=False)}"
        )
    calls = (
        "call"
        if request.choice == "function" or not request.parallel
        else (f"call ({lark_literal(chr(10))} call)*")
    )
    alternatives = " | ".join(f"call_{i}" for i in range(len(names)))
    start = f"start: {CALLS_BEGIN} {calls} {CALLS_END}\ncall: {alternatives}"
    return GrammarSpec.lark("\n".join([start, *rules]) + "\n")


def _names(request: ToolRequest) -> list[str]:
    return [t["function"]["name"] for t in request.tools]


def _check_schema(request: ToolRequest, name: str, schema: dict[str, Any]) -> None:
    index = _names(request).index(name)
    try:
        GrammarSpec.json_schema(schema).validate()
    except InvalidRequestError as exc:
        raise bad_param(f"tools[{index}].function.parameters", exc.reason) from exc


def apply_tool_choice(
    params: SamplingParams, request: ToolRequest, tokenizer: Tokenizer
) -> SamplingParams:
    """``params`` with what the choice asks: the call grammar when it is enforced, the end of
    a call as a stop token when only one call may come and nothing else enforces it."""
    if not request.parses:
        return params
    if request.enforced:
        if params.grammar is not None:
            raise bad_param(
                "tool_choice",
                f"{request.choice!r} cannot be combined with response_format or another grammar",
            )
        _tool_token_ids(tokenizer)
        return dataclasses.replace(params, grammar=tool_call_grammar(request))
    if not request.parallel:
        call_end = _tool_token_ids(tokenizer)[CALL_END]
        stops = tuple(dict.fromkeys((*params.stop_token_ids, call_end)))
        return dataclasses.replace(params, stop_token_ids=stops)
    return params


def _tool_token_ids(tokenizer: Tokenizer) -> dict[str, int]:
    """The id of each of DeepSeek-V3's tool-call tokens; 400 when the model has none, or has
    them as ``special`` tokens (the gateway detokenizes with ``skip_special_tokens``)."""
    ids = {}
    for token in TOOL_TOKENS:
        encoded = tokenizer.encode(token, add_special_tokens=False)
        if len(encoded) != 1:
            raise bad_param(
                "tool_choice",
                f"this model's tokenizer has no {token} token (DeepSeek-V3's tool-call format), "
                "so tool calls cannot be enforced",
            )
        if tokenizer.decode(encoded, skip_special_tokens=True) != token:
            raise bad_param(
                "tool_choice",
                f"this model's tokenizer marks {token} special: the output text drops it, so "
                "tool calls could not be parsed",
            )
        ids[token] = encoded[0]
    return ids
