"""References the OpenAI-route tests compare with, computed independently of the gateway."""

from __future__ import annotations

from collections.abc import Sequence

from dsmesh.engine.tokenizer import Tokenizer


def reference_text_offsets(tok: Tokenizer, ids: Sequence[int]) -> list[int]:
    """Where each token's text starts in ``decode(ids, skip_special_tokens=True)``, in
    characters: the index of the character holding the token's first byte, counted as the
    UTF-8 lead bytes up to it (a special token's offset is where the text goes on)."""
    shown = b""
    offsets = []
    for token_id in ids:
        skipped = tok.decode([token_id], skip_special_tokens=True) == ""
        raw = b"" if skipped else tok.token_bytes(token_id)
        leads = sum(1 for b in shown + raw[:1] if b & 0xC0 != 0x80)
        offsets.append(leads - 1 if raw else leads)
        shown += raw
    return offsets
