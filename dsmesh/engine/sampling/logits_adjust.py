"""Per-request logit adjustments before sampling: logit bias and the repetition, frequency
and presence penalties, batched over the rows of a step on the logits' device.

Semantics and order follow vLLM (and, for ``repetition_penalty``, HF transformers): the bias is
added first; then, for every token that occurs in the request's prompt or output,
``repetition_penalty`` divides a positive logit and multiplies a negative one; then
``frequency_penalty * count`` and ``presence_penalty * (count > 0)`` are subtracted, with
``count`` the token's occurrences in the output only. :func:`adjust_logits_ref` is the same
thing row by row in plain torch, the reference the tests hold the batched version to.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from dsmesh.engine.sampling.params import SamplingParams


def adjust_logits(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    prompt_ids: Sequence[Sequence[int]],
    output_ids: Sequence[Sequence[int]],
) -> torch.Tensor:
    """logits [n, vocab] (any float dtype) -> adjusted logits [n, vocab] float32, a new tensor.

    Row i uses ``params[i]`` and the request's ``prompt_ids[i]`` and ``output_ids[i]`` (read
    only for rows with a penalty). Rows without adjustments come back unchanged. Token ids are
    copied to the device once per call: a penalised row costs one upload of its tokens.
    """
    n, vocab = logits.shape
    device = logits.device
    out = logits.to(torch.float32, copy=True)
    bias = [(i, tok, b) for i, p in enumerate(params) for tok, b in p.logit_bias]
    if bias:
        rows, ids, values = zip(*bias, strict=True)
        out.index_put_(
            (_on(device, rows, torch.int64), _on(device, ids, torch.int64)),
            _on(device, values, torch.float32),
            accumulate=True,
        )
    penalised = [i for i, p in enumerate(params) if p.has_penalties]
    if not penalised:
        return out
    prompt_ids, output_ids = own_tokens(params, prompt_ids, output_ids)
    rows_t = _on(device, penalised, torch.int64)
    sub = out.index_select(0, rows_t)  # [r, vocab]
    counts = _token_counts([output_ids[i] for i in penalised], vocab, device)
    present = counts > 0
    rep = _on(device, [params[i].repetition_penalty for i in penalised], torch.float32)
    if any(params[i].repetition_penalty != 1.0 for i in penalised):
        seen = present | (_token_counts([prompt_ids[i] for i in penalised], vocab, device) > 0)
        rep = rep.unsqueeze(1)
        sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    freq = _on(device, [params[i].frequency_penalty for i in penalised], torch.float32)
    presence = _on(device, [params[i].presence_penalty for i in penalised], torch.float32)
    sub = sub - freq.unsqueeze(1) * counts - presence.unsqueeze(1) * present.float()
    out.index_copy_(0, rows_t, sub)
    return out


def adjust_logits_ref(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    prompt_ids: Sequence[Sequence[int]],
    output_ids: Sequence[Sequence[int]],
) -> torch.Tensor:
    """:func:`adjust_logits`, one row and one token at a time (the tests' reference)."""
    out = logits.to(torch.float32, copy=True)
    prompt_ids, output_ids = own_tokens(params, prompt_ids, output_ids)
    for i, p in enumerate(params):
        row = out[i]
        for tok, b in p.logit_bias:
            row[tok] += b
        if p.repetition_penalty != 1.0:
            for tok in set(prompt_ids[i]) | set(output_ids[i]):
                value = row[tok]
                row[tok] = (
                    value / p.repetition_penalty if value > 0 else value * p.repetition_penalty
                )
        for tok in set(output_ids[i]):
            count = list(output_ids[i]).count(tok)
            row[tok] -= p.frequency_penalty * count + p.presence_penalty
    return out


def own_tokens(
    params: Sequence[SamplingParams],
    prompt_ids: Sequence[Sequence[int]],
    output_ids: Sequence[Sequence[int]],
) -> tuple[list[Sequence[int]], list[Sequence[int]]]:
    """Each row's (prompt, output) as the penalties see them: a resumed request's last
    ``resumed_tokens`` prompt tokens are its own earlier output (SamplingParams)."""
    prompts, outputs = list(prompt_ids), list(output_ids)
    for i, p in enumerate(params):
        r = p.resumed_tokens
        if r and p.has_penalties:
            prompt = list(prompts[i])
            prompts[i], outputs[i] = prompt[:-r], prompt[-r:] + list(outputs[i])
    return prompts, outputs


def _on(device: torch.device, values: Sequence, dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=device)


def _token_counts(
    sequences: Sequence[Sequence[int]], vocab: int, device: torch.device
) -> torch.Tensor:
    """Occurrences of each token id in each sequence: [len(sequences), vocab] float32."""
    width = max((len(s) for s in sequences), default=0)
    counts = torch.zeros(len(sequences), vocab + 1, dtype=torch.float32, device=device)
    if width == 0:
        return counts[:, :vocab]
    ids = np.full((len(sequences), width), vocab, dtype=np.int64)  # padding counts in column vocab
    for i, seq in enumerate(sequences):
        ids[i, : len(seq)] = seq
    index = torch.from_numpy(ids).to(device)
    counts.scatter_add_(1, index, torch.ones(index.shape, dtype=torch.float32, device=device))
    return counts[:, :vocab]


def min_tokens_bans(
    params: Sequence[SamplingParams],
    output_ids: Sequence[Sequence[int]],
    eos_token_ids: Sequence[int],
) -> list[tuple[int, int]]:
    """(row, token id) pairs that row i may not sample now: while it has generated fewer than
    ``params[i].min_tokens`` tokens, its ``stop_token_ids`` and, unless ``ignore_eos``, the
    model's EOS tokens (vLLM's min_tokens)."""
    bans: list[tuple[int, int]] = []
    for i, p in enumerate(params):
        if len(output_ids[i]) >= p.min_tokens:
            continue
        stops = set(p.stop_token_ids)
        if not p.ignore_eos:
            stops.update(eos_token_ids)
        bans += [(i, tok) for tok in sorted(stops)]
    return bans


def mask_tokens(logits: torch.Tensor, bans: Sequence[tuple[int, int]]) -> torch.Tensor:
    """logits [n, vocab] -> a new tensor with ``-inf`` at every (row, token id) of ``bans``."""
    if not bans:
        return logits
    rows, ids = zip(*bans, strict=True)
    index = (_on(logits.device, rows, torch.int64), _on(logits.device, ids, torch.int64))
    return logits.index_put(
        index, torch.full((), -torch.inf, dtype=logits.dtype, device=logits.device)
    )
