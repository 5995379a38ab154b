"""Completions' ``echo``: the prompt before each choice's text and, with ``logprobs``, the
prompt tokens' logprobs before the generated tokens', as OpenAI's legacy completions and vLLM
give them. With ``max_tokens: 0`` that is prompt scoring: lm-eval-harness's
local-completions reads ``token_logprobs`` and ``top_logprobs`` of the prompt for
log-likelihood tasks.

The prompt's first token has no logprob: its ``token_logprobs`` and ``top_logprobs`` entries
are null. ``text_offset`` runs on over the prompt's token strings into the generated ones'.
The prompt logprobs are computed once, by choice 0 (dsmesh/gateway/choices.py), and every choice
echoes them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dsmesh.engine.sampling.token_logprobs import TokenLogprobs
from dsmesh.gateway.openai_logprobs import LogprobsFormatter


@dataclass
class EchoedPrompt:
    """What every choice of one request echoes: the prompt's ``text`` (as the client sent
    it, or its token ids decoded) and ``ids``. ``entries``: its logprobs, one per token after
    the first, once choice 0's first delta brought them (None until then, and when the
    request asks for no logprobs)."""

    text: str
    ids: list[int]
    entries: list[TokenLogprobs] | None = None

    def logprobs(self, formatter: LogprobsFormatter) -> dict[str, Any]:
        """The prompt's part of a choice's completions logprobs; render it before the
        choice's own (it advances the formatter's ``text_offset``)."""
        if self.entries is None or len(self.entries) != len(self.ids) - 1:
            raise ValueError("the prompt logprobs have not come")
        return join_logprobs(formatter.unscored(self.ids[0]), formatter.completion(self.entries))


def join_logprobs(*parts: dict[str, Any]) -> dict[str, Any]:
    """Completions logprobs of consecutive stretches of text as one."""
    keys = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    return {key: [item for part in parts for item in part[key]] for key in keys}
