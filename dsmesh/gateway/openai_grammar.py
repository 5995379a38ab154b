"""Structured outputs on the OpenAI routes: the request fields that constrain the output, as
one :class:`GrammarSpec` (dsmesh/engine/sampling/grammar.py, enforced by the engine's sampler).

Accepted, at most one per request:

- ``response_format`` (OpenAI): ``{"type": "text"}`` (no constraint), ``{"type":
  "json_object"}``, or ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...},
  "strict": ..., "description": ...}}``; the schema is enforced whether ``strict`` is true or
  not (vLLM and SGLang do the same).
- vLLM's extra fields: ``guided_json`` (a schema, object or JSON text), ``guided_regex``,
  ``guided_grammar`` (GBNF or Lark), ``guided_choice`` (a list of strings).
- SGLang's extra fields: ``json_schema`` (JSON text), ``regex``, ``ebnf``.

Errors are InvalidRequestError naming the field as the client sent it
(``response_format.json_schema.schema``), which the routes answer with a 400.
"""

from __future__ import annotations

import json
from typing import Any

from dsmesh.engine.errors import InvalidRequestError
from dsmesh.engine.sampling.grammar import GrammarSpec, lark_literal

# field -> the kind of GrammarSpec it gives (besides response_format)
EXTRA_FIELDS = {
    "guided_json": "json_schema",
    "guided_regex": "regex",
    "guided_grammar": "ebnf",
    "guided_choice": "lark",
    "json_schema": "json_schema",
    "regex": "regex",
    "ebnf": "ebnf",
}
_JSON_SCHEMA_KEYS = frozenset({"name", "schema", "strict", "description"})


def grammar_from_openai(body: dict[str, Any]) -> GrammarSpec | None:
    """The request's output constraint, checked (InvalidRequestError naming the client's
    field when it is invalid), or None when it asks for none."""
    found: list[tuple[str, GrammarSpec]] = []
    spec = _response_format(body.get("response_format"))
    if spec is not None:
        found.append((_response_format_field(spec), spec))
    for name, kind in EXTRA_FIELDS.items():
        value = body.get(name)
        if value is not None:
            found.append((name, _extra(name, kind, value)))
    if len(found) > 1:
        names = ", ".join(name.split(".")[0] for name, _ in found)
        raise InvalidRequestError(
            found[1][0].split(".")[0], f"only one output constraint at a time: {names}"
        )
    if not found:
        return None
    field, spec = found[0]
    try:
        spec.validate()
    except InvalidRequestError as exc:
        raise InvalidRequestError(field, exc.reason) from None
    return spec


def _response_format_field(spec: GrammarSpec) -> str:
    if spec.kind == "json_schema":
        return "response_format.json_schema.schema"
    return "response_format"


def _response_format(value: Any) -> GrammarSpec | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidRequestError("response_format", "must be an object")
    kind = value.get("type")
    if kind not in ("text", "json_object", "json_schema"):
        raise InvalidRequestError(
            "response_format.type", f'must be "text", "json_object" or "json_schema", got {kind!r}'
        )
    extra = set(value) - {"type", "json_schema"}
    if extra:
        raise InvalidRequestError(f"response_format.{sorted(extra)[0]}", "unknown field")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec.json_object()
    inner = value.get("json_schema")
    if not isinstance(inner, dict):
        raise InvalidRequestError("response_format.json_schema", "must be an object with a schema")
    for key in inner:
        if key not in _JSON_SCHEMA_KEYS:
            raise InvalidRequestError(f"response_format.json_schema.{key}", "unknown field")
    name = inner.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidRequestError(
            "response_format.json_schema.name", "required: a non-empty string (as OpenAI's)"
        )
    strict = inner.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise InvalidRequestError("response_format.json_schema.strict", "must be a boolean")
    schema = inner.get("schema")
    if schema is None:
        # OpenAI's SDK always sends one; an omitted schema allows any JSON value (vLLM).
        schema = {}
    if not isinstance(schema, dict):
        raise InvalidRequestError(
            "response_format.json_schema.schema", "must be an object (a JSON Schema)"
        )
    return GrammarSpec.json_schema(schema)


def _extra(name: str, kind: str, value: Any) -> GrammarSpec:
    if name == "guided_choice":
        if not (isinstance(value, list) and value and all(isinstance(v, str) and v for v in value)):
            raise InvalidRequestError(name, "must be a non-empty list of non-empty strings")
        return GrammarSpec.lark("start: " + " | ".join(lark_literal(v) for v in value))
    if kind == "json_schema" and isinstance(value, dict):
        return GrammarSpec.json_schema(value)
    if not isinstance(value, str):
        raise InvalidRequestError(
            name, "must be a string" + (" or an object" if kind == "json_schema" else "")
        )
    if kind == "json_schema":
        try:
            json.loads(value)
        except json.JSONDecodeError as exc:
            raise InvalidRequestError(name, f"is not valid JSON: {exc}") from exc
    return GrammarSpec(kind, value)
