"""Errors the engine raises for a caller to map onto its protocol (gRPC status, HTTP code)."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request is malformed; ``field`` names the offending input (e.g. ``input_ids``)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
