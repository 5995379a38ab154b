"""Logprobs in the OpenAI API's shapes, from the engine's :class:`TokenLogprobs`.

Chat (``choices[i].logprobs``)::

    {"content": [{"token": "Hi", "logprob": -0.1, "bytes": [72, 105],
                  "top_logprobs": [{"token": "Hi", "logprob": -0.1, "bytes": [72, 105]}, ...]},
                 ...],
     "refusal": null}

Completions (the legacy shape)::

    {"tokens": ["Hi", ...], "token_logprobs": [-0.1, ...],
     "top_logprobs": [{"Hi": -0.1, "Hello": -2.3}, ...], "text_offset": [0, ...]}

A token's string is its text, or, when it is only part of a UTF-8 character, its bytes escaped
as ``\\xNN``; ``bytes`` always holds the exact bytes. Completions' ``top_logprobs`` holds the
requested top tokens and the generated one (OpenAI: up to ``logprobs + 1`` entries); chat's
holds exactly ``top_logprobs`` entries. ``text_offset`` is where each token's text starts in the
choice's text, in characters: the tokens' bytes before it decoded as the text is (special
tokens skipped, a character split over tokens starting at its first token), so an escaped
byte token or a skipped BOS never shifts the later offsets. Logprobs below -9999 (an
impossible token) are reported as -9999, which JSON can carry.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from typing import Any

from dsmesh.engine.sampling.token_logprobs import TokenLogprobs
from dsmesh.engine.tokenizer import Tokenizer

MIN_LOGPROB = -9999.0


class LogprobsFormatter:
    """Renders one choice's logprobs; keeps the completions' running ``text_offset``."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._offset = 0  # characters of the text so far (complete characters only)
        self._text = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._skipped: dict[int, bool] = {}  # token id -> a special token the text skips

    def token(self, token_id: int) -> tuple[str, list[int]]:
        """The token's string and its bytes."""
        raw = self._tokenizer.token_bytes(token_id)
        return raw.decode("utf-8", errors="backslashreplace"), list(raw)

    def chat(self, entries: Sequence[TokenLogprobs]) -> dict[str, Any]:
        content = []
        for entry in entries:
            item = self._chat_item(entry.token_id, entry.logprob)
            item["top_logprobs"] = [self._chat_item(t, lp) for t, lp in entry.top]
            content.append(item)
        return {"content": content, "refusal": None}

    def completion(self, entries: Sequence[TokenLogprobs]) -> dict[str, Any]:
        tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
        for entry in entries:
            text, _ = self.token(entry.token_id)
            tokens.append(text)
            token_logprobs.append(_clamp(entry.logprob))
            top = {self.token(t)[0]: _clamp(lp) for t, lp in entry.top}
            top.setdefault(text, _clamp(entry.logprob))
            top_logprobs.append(top)
            offsets.append(self._advance(entry.token_id))
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top_logprobs,
            "text_offset": offsets,
        }

    def unscored(self, token_id: int) -> dict[str, Any]:
        """Completions' entry of a token that has no logprob (an echoed prompt's first):
        null ``token_logprobs`` and ``top_logprobs``."""
        text, _ = self.token(token_id)
        out = {"tokens": [text], "token_logprobs": [None], "top_logprobs": [None]}
        out["text_offset"] = [self._advance(token_id)]
        return out

    def _advance(self, token_id: int) -> int:
        """The offset of ``token_id``'s text, then the text runs on past it."""
        offset = self._offset
        skipped = self._skipped.get(token_id)
        if skipped is None:
            skipped = self._tokenizer.decode([token_id], skip_special_tokens=True) == ""
            self._skipped[token_id] = skipped
        if not skipped:
            self._offset += len(self._text.decode(self._tokenizer.token_bytes(token_id)))
        return offset

    def _chat_item(self, token_id: int, logprob: float) -> dict[str, Any]:
        text, raw = self.token(token_id)
        return {"token": text, "logprob": _clamp(logprob), "bytes": raw}


def _clamp(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)
