"""Prompt logprobs (``SamplingParams.prompt_logprobs``): each prompt token's log-probability
given the tokens before it, computed during prefill, chunk by chunk.

Prompt token j (j >= 1) is scored by the logits at position j - 1, so a prefill chunk that
computes positions [start, end) scores prompt tokens start + 1 .. end (the last prompt
position's logits are the first generated token's, not a prompt token's). The first prompt
token has no logprob. Logits are materialised :data:`SCORE_ROWS` positions at a time, so a
long prompt never needs [prompt, vocab] floats, nor even [chunk, vocab].

Positions a request skips are never scored, so a request that still owes prompt logprobs
takes no prefix-cache hit (``Request.owes_prompt_logprobs``, dsmesh/engine/sched/scheduler.py), as
vLLM does. A request retracted and recomputed scores each position once:
``Request.num_prompt_scored`` remembers how far it got.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from dsmesh.engine.sampling.token_logprobs import TokenLogprobs

SCORE_ROWS = 256  # positions whose logits are materialised at once: [256, vocab] float32


def positions_to_score(start: int, end: int, prompt_len: int, num_scored: int) -> range:
    """Positions of the chunk [start, end) whose logits score a prompt token not yet scored:
    position p scores prompt token p + 1; tokens 1 .. ``num_scored`` were scored already."""
    return range(max(start, num_scored), min(end, prompt_len - 1))


def score_tokens(
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    target_ids: Sequence[int],
    k: int,
    rows_at_once: int = SCORE_ROWS,
) -> list[TokenLogprobs]:
    """hidden [n, hidden] (final hidden states of n positions) and the n tokens that follow
    them -> each token's logprob and the ``k`` most likely tokens at its position, under the
    raw distribution (``log_softmax`` of the logits). ``compute_logits`` maps hidden states
    [r, hidden] to float32 logits [r, vocab]; it is called on ``rows_at_once`` rows at most.
    """
    if hidden.shape[0] != len(target_ids):
        raise ValueError(f"{hidden.shape[0]} positions for {len(target_ids)} target tokens")
    out: list[TokenLogprobs] = []
    targets = torch.tensor(list(target_ids), dtype=torch.int64, device=hidden.device)
    for lo in range(0, len(target_ids), rows_at_once):
        hi = min(lo + rows_at_once, len(target_ids))
        logprobs = torch.log_softmax(compute_logits(hidden[lo:hi]).float(), dim=-1)
        chosen = logprobs.gather(1, targets[lo:hi, None])  # [r, 1]
        top_values, top_ids = logprobs.topk(min(k, logprobs.shape[1]), dim=-1)  # [r, k]
        # One copy to the host: float64 holds every token id and float32 logprob exactly.
        table = torch.cat([chosen.double(), top_ids.double(), top_values.double()], 1).tolist()
        width = top_ids.shape[1]
        for token, row in zip(target_ids[lo:hi], table, strict=True):
            top = tuple(
                (int(t), v) for t, v in zip(row[1 : 1 + width], row[1 + width :], strict=True)
            )
            out.append(TokenLogprobs(int(token), row[0], top))
    return out


def prompt_logprobs_ref(
    logits: torch.Tensor, prompt_ids: Sequence[int], k: int
) -> list[TokenLogprobs]:
    """The tests' reference: logits [len(prompt), vocab] of the whole prompt run at once ->
    the logprobs of prompt tokens 1 .. len - 1, one position at a time."""
    out = []
    for j in range(1, len(prompt_ids)):
        logprobs = torch.log_softmax(logits[j - 1].float(), dim=-1)
        values, ids = logprobs.topk(k)
        top = tuple((int(t), float(v)) for t, v in zip(ids, values, strict=True))
        out.append(TokenLogprobs(prompt_ids[j], float(logprobs[prompt_ids[j]]), top))
    return out
