"""Argument types the sub-commands share: each parses one flag's text or raises
``argparse.ArgumentTypeError`` with a message that names what was expected."""

from __future__ import annotations

import argparse
import math


def _error(message: str) -> argparse.ArgumentTypeError:
    return argparse.ArgumentTypeError(message)


def number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise _error(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise _error(f"expected a finite number, got {text!r}")
    return value


def seconds(text: str) -> float:
    """A duration > 0."""
    value = number(text)
    if not value > 0:
        raise _error(f"must be a positive number of seconds, got {text}")
    return value


def seconds_or_zero(text: str) -> float:
    """A duration >= 0 (0: none)."""
    value = number(text)
    if value < 0:
        raise _error(f"must not be negative, got {text}")
    return value


def integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise _error(f"expected an integer, got {text!r}") from None


def count(text: str) -> int:
    """An integer >= 0."""
    value = integer(text)
    if value < 0:
        raise _error(f"must not be negative, got {text}")
    return value


def positive(text: str) -> int:
    """An integer >= 1."""
    value = integer(text)
    if value < 1:
        raise _error(f"must be >= 1, got {text}")
    return value


def port(text: str) -> int:
    """A TCP port; 0 picks any free one."""
    value = integer(text)
    if not 0 <= value <= 65535:
        raise _error(f"must be in 0..65535, got {text}")
    return value


def share(text: str) -> float:
    """A fraction in (0, 1]."""
    value = number(text)
    if not 0 < value <= 1:
        raise _error(f"must be in (0, 1], got {text}")
    return value


def below_one(text: str) -> float:
    """A fraction in [0, 1)."""
    value = number(text)
    if not 0 <= value < 1:
        raise _error(f"must be in [0, 1), got {text}")
    return value


def switch(text: str) -> bool:
    """On or off: 1/0, true/false, yes/no, on/off (an environment variable's spelling)."""
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("", "0", "false", "no", "off"):
        return False
    raise _error(f"must be 1/0 (or true/false), got {text!r}")


def int_range(text: str) -> tuple[int, int]:
    """``"A"`` or ``"A,B"`` (inclusive, 1 <= A <= B) as a pair of ints: a token length
    drawn uniformly (``dsmesh bench``, ``dsmesh plan``)."""
    try:
        parts = [int(x) for x in text.split(",")]
    except ValueError:
        raise _error(f"expected N or MIN,MAX, got {text!r}") from None
    if len(parts) == 1:
        parts *= 2
    if len(parts) != 2 or not 1 <= parts[0] <= parts[1]:
        raise _error(f"expected N or MIN,MAX with 1 <= MIN <= MAX: {text!r}")
    return parts[0], parts[1]
