"""Errors the engine raises for a caller to map onto its protocol (gRPC status, HTTP code)."""

from __future__ import annotations

# Torch-free: the gateway imports this module (it never imports torch, so that it starts fast),
# hence the page arithmetic of dsmesh/engine/kv/pool.py's pages_for is spelled out below.


class InvalidRequestError(ValueError):
    """A request is malformed: ``field`` names the offending input (``input_ids``,
    ``sampling.top_p``) and ``reason`` says what is wrong with it. Every layer maps it the
    same way: gRPC INVALID_ARGUMENT / HTTP 400 with the message ``"<field>: <reason>"``."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason

    def within(self, parent: str) -> InvalidRequestError:
        """The same error for a field nested in ``parent`` (``top_p`` -> ``sampling.top_p``)."""
        return type(self)(f"{parent}.{self.field}", self.reason)


def check_prompt(
    ids: list[int], vocab_size: int, max_context: int, field: str = "input_ids"
) -> None:
    """The prompt checks every entry point shares: not empty, ids in the vocabulary, room
    left in the context to generate. Raises InvalidRequestError naming ``field``."""
    if not ids:
        raise InvalidRequestError(field, "the prompt is empty")
    for i, tok in enumerate(ids):
        if not 0 <= tok < vocab_size:
            raise InvalidRequestError(
                field, f"token {i} is {tok}, outside the vocabulary [0, {vocab_size})"
            )
    if len(ids) >= max_context:
        raise InvalidRequestError(
            field,
            f"prompt has {len(ids)} tokens; the model's context is {max_context}, "
            "which leaves no room to generate",
        )


def check_fits_pool(
    num_prompt: int, new_tokens: int, max_context: int, page_size: int, num_pages: int
) -> int:
    """A request of ``num_prompt`` tokens that may generate ``new_tokens`` must fit a pool of
    ``num_pages`` pages alone: pages come as its tokens need them, and the oldest request can
    always reclaim every page by retracting the newer ones. Returns the tokens it may reach
    (prompt + new tokens, at most the context); InvalidRequestError naming ``input_ids`` or
    ``sampling.max_new_tokens`` when it could never fit."""
    first = -(-(num_prompt + 1) // page_size)
    if first > num_pages:
        raise InvalidRequestError(
            "input_ids",
            f"prompt has {num_prompt} tokens; with its first new token it needs {first} KV "
            f"pages but the pool has only {num_pages}",
        )
    total = min(num_prompt + new_tokens, max_context)
    need = -(-total // page_size)
    if need > num_pages:
        raise InvalidRequestError(
            "sampling.max_new_tokens",
            f"prompt + max_new_tokens needs {need} KV pages but the pool has only {num_pages}",
        )
    return total
