"""Validate what the gateway answers against the ``openai`` package's own response models.

``conform(model, obj)`` validates ``obj`` in pydantic's strict mode (no coercion: a string is
never taken for a number, nor a number for a string) and then checks that no object anywhere in
it carries a field the SDK's model does not declare: the SDK's models accept extra fields
(``extra="allow"``), so strict validation alone would let a misspelt or invented field through.
"""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel

M = TypeVar("M", bound=BaseModel)


def conform(model: type[M], obj: Any) -> M:
    parsed = model.model_validate(obj, strict=True)
    unknown = list(_extra_fields(parsed, model.__name__))
    assert not unknown, f"fields the openai package's {model.__name__} does not know: {unknown}"
    return parsed


def _extra_fields(value: Any, path: str):
    if isinstance(value, BaseModel):
        for name in value.model_extra or {}:
            yield f"{path}.{name}"
        for name in type(value).model_fields:
            yield from _extra_fields(getattr(value, name), f"{path}.{name}")
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            yield from _extra_fields(item, f"{path}[{i}]")
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _extra_fields(item, f"{path}[{key!r}]")
