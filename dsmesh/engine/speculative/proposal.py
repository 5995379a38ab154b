"""The drafts of one request: what waits on it, and pure policies over it.

Which requests can have their drafts verified exactly, how many drafts are worth making (at
most K, none past the request's last token), which waiting drafts are still valid, and the
drafts a prefill instance hands to decode with the first token. Nothing here runs a forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsmesh.engine.request import Request
from dsmesh.engine.sampling.sampler import GREEDY_BELOW


@dataclass
class DraftProposal:
    """Drafts waiting on a request: valid while the request still has ``num_tokens`` tokens
    (a later step, a retraction's recompute, or a plain step makes them stale)."""

    num_tokens: int
    token_ids: list[int]
    probs: torch.Tensor | None  # [k, vocab] float32, the q each draft was drawn from (sampled)


def takes_argmax(req: Request) -> bool:
    """The request's token is the argmax of the raw logits and nothing else is reported
    about it: a greedy speculative step can resolve it on the device."""
    p = req.params
    return (
        p.temperature < GREEDY_BELOW
        and not p.adjusts_logits
        and p.logprobs is None
        and getattr(req, "grammar", None) is None
    )


def drafts_allowed(req: Request) -> bool:
    """Whether ``req``'s sampling can be verified against drafts exactly."""
    p = req.params
    if getattr(req, "grammar", None) is not None:
        return False
    return p.temperature < GREEDY_BELOW or not p.adjusts_logits


def num_drafts(req: Request, k: int) -> int:
    """Drafts worth making for ``req`` now: at most ``k``, none past its last token."""
    if not drafts_allowed(req):
        return 0
    if req.prefill_only:
        return num_handoff_drafts(req, k)
    left = min(
        req.params.max_new_tokens - len(req.output_ids), req.max_total_tokens - req.num_tokens
    )
    return max(0, min(k, left - 1))


def valid_drafts(req: Request, k: int) -> list[int]:
    """The drafts waiting on ``req`` that its next step verifies (none when stale)."""
    proposal = req.spec_draft
    if proposal is None or proposal.num_tokens != req.num_tokens:
        return []
    return proposal.token_ids[: num_drafts(req, k)]


def num_handoff_drafts(req: Request, k: int) -> int:
    """Drafts a prefill instance makes for decode's first step: greedy requests only (a
    sampled draft is verified against the q it was drawn from, [k, vocab] float32, too
    heavy for the handoff), at most ``k``, none past ``max_new_tokens``; decode trims them
    to its own limits (:func:`valid_drafts`)."""
    if req.params.temperature >= GREEDY_BELOW:
        return 0
    left = req.params.max_new_tokens - len(req.output_ids)
    return max(0, min(k, left - 1))


def handoff_drafts(req: Request) -> list[int]:
    """Prefill: the drafts a prefilled request hands to decode with its first token
    (greedy requests; empty for others)."""
    proposal = req.spec_draft
    if proposal is None or proposal.probs is not None or proposal.num_tokens != req.num_tokens:
        return []
    return list(proposal.token_ids)


def tokens_between(req: Request, start: int, end: int) -> list[int]:
    """Tokens ``[start, end)`` of prompt + output, without copying the whole prompt."""
    n_prompt = len(req.prompt_ids)
    if end <= n_prompt:
        return req.prompt_ids[start:end]
    if start >= n_prompt:
        return req.output_ids[start - n_prompt : end - n_prompt]
    return req.prompt_ids[start:] + req.output_ids[: end - n_prompt]

