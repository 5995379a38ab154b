"""Allowed-token bitmasks applied to logits (structured outputs, dsmesh/engine/sampling/grammar.py).

A bitmask row is ``ceil(vocab / 32)`` int32 words; token ``t`` is allowed when bit ``t % 32``
of word ``t // 32`` is set (llguidance's and xgrammar's layout). :func:`apply_token_bitmask`
unpacks it on the logits' device in a few elementwise kernels, outside any CUDA graph (the
mask changes every step); :func:`apply_token_bitmask_ref` is the row-by-row reference.
"""

from __future__ import annotations

import math

import torch


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits [n, vocab] (any float dtype), bitmask [n, words] int32 (any device, words * 32
    >= vocab) -> a new tensor of logits with the disallowed tokens at -inf; dtype kept."""
    n, vocab = logits.shape
    if bitmask.shape[0] != n or bitmask.shape[1] * 32 < vocab:
        raise ValueError(
            f"bitmask {tuple(bitmask.shape)} does not cover logits {tuple(logits.shape)}"
        )
    words = bitmask.to(logits.device, non_blocking=True)
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).view(n, -1)[:, :vocab].bool()
    return logits.masked_fill(~allowed, -math.inf)


def apply_token_bitmask_ref(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """:func:`apply_token_bitmask` one token at a time (the tests' reference)."""
    out = logits.clone()
    words = bitmask.cpu().tolist()
    for i in range(out.shape[0]):
        for t in range(out.shape[1]):
            if not (words[i][t // 32] >> (t % 32)) & 1:
                out[i, t] = -math.inf
    return out
