"""Which drafted tokens a verification keeps: the policies of speculative decoding.

Pure functions over one request's tensors. A request drafted ``k`` tokens ``d_1 .. d_k``; the
target model then scored ``k + 1`` positions (the last known token, then each draft), whose
sampling distributions are ``p_1 .. p_{k+1}``.

- Greedy: keep the longest prefix of drafts equal to the target's argmax tokens, then the
  target's token after it; the output is exactly non-speculative greedy decoding.
- Sampling: the rejection sampling of Leviathan et al. (2023) and Chen et al. (2023): keep
  ``d_i`` with probability ``min(1, p_i(d_i) / q_i(d_i))``, where ``q_i`` is the draft
  distribution ``d_i`` was drawn from; at the first rejection draw from
  ``norm(max(p_i - q_i, 0))`` and stop; if every draft is kept draw one more from
  ``p_{k+1}``. Each emitted token is distributed exactly as the target's ``p``.

Both ``p`` and ``q`` come from :func:`sampling_probs`, the sampler's own transform
(temperature, top-k, top-p over the top-k survivors, min-p), so the target distribution is the
one non-speculative sampling draws from.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from dsmesh.engine.sampling.params import SamplingParams
from dsmesh.engine.sampling.sampler import _top_k_top_p_mask


def sampling_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """float32 logits [n, vocab] -> the probabilities [n, vocab] that
    :class:`dsmesh.engine.sampling.sampler.Sampler` draws row i from under ``params[i]``
    (temperature > 0, no logit adjustment): temperature, then top-k, top-p and min-p,
    renormalised."""
    device = logits.device
    vocab = logits.shape[1]
    temperature = torch.tensor([p.temperature for p in params], device=device)
    scaled = logits.float() / temperature.unsqueeze(1)
    keep: torch.Tensor | None = None
    use_top_k = any(0 < p.top_k < vocab for p in params)
    use_top_p = any(p.top_p < 1.0 for p in params)
    if use_top_k or use_top_p:
        keep = _top_k_top_p_mask(scaled, params, use_top_k, use_top_p)
    if any(p.min_p > 0.0 for p in params):
        log_min_p = torch.tensor(
            [math.log(p.min_p) if p.min_p > 0 else -math.inf for p in params], device=device
        )
        min_p_keep = scaled >= scaled.amax(dim=-1, keepdim=True) + log_min_p.unsqueeze(1)
        keep = min_p_keep if keep is None else keep & min_p_keep
    if keep is not None:
        scaled = scaled.masked_fill(~keep, -math.inf)
    return torch.softmax(scaled, dim=-1)


def uniform(generator: torch.Generator | None, device: torch.device) -> float:
    """One uniform in [0, 1) from ``generator`` (the default RNG when None)."""
    if generator is None:
        return float(torch.rand(1, device=device))
    return float(torch.rand(1, generator=generator, device=generator.device))


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from ``probs`` [vocab] (any non-negative mass) by inverse CDF."""
    cdf = torch.cumsum(probs.float(), dim=0)
    target = uniform(generator, probs.device) * float(cdf[-1])
    token = int(torch.searchsorted(cdf, torch.tensor([target], device=cdf.device), right=True))
    last_kept = int(torch.nonzero(probs > 0).max()) if bool((probs > 0).any()) else 0
    return min(token, last_kept)  # rounding can put the target at the total mass


def accept_greedy(draft_ids: Sequence[int], target_ids: Sequence[int]) -> int:
    """How many leading drafts equal the target's tokens (``target_ids`` has one more: the
    token after the last draft); the kept tokens are ``target_ids[: accepted + 1]``."""
    accepted = 0
    for d, t in zip(draft_ids, target_ids, strict=False):
        if d != t:
            break
        accepted += 1
    return accepted


def accept_greedy_rows(
    fed_ids: torch.Tensor, target_ids: torch.Tensor, first_rows: torch.Tensor,
    num_drafts: torch.Tensor, k: int,
) -> torch.Tensor:  # fmt: skip
    """:func:`accept_greedy` of many requests at once, on the device (no host sync).

    A verify step lays each request's rows end to end: request ``i`` from row
    ``first_rows[i]``, its last token then its ``num_drafts[i] <= k`` drafts. ``fed_ids`` [R]
    are the tokens the rows fed, ``target_ids`` [R] the target's token at each row. Returns
    the accepted drafts [n] int64: the leading drafts equal to the target's token one row up.
    """
    j = torch.arange(k, device=fed_ids.device)
    rows = first_rows[:, None] + j  # [n, k]: the target's row before draft j + 1
    last = fed_ids.shape[0] - 1  # indices past a request's rows are masked below
    same = fed_ids[(rows + 1).clamp(max=last)] == target_ids[rows.clamp(max=last)]
    same &= j < num_drafts[:, None]
    return same.to(torch.int64).cumprod(dim=1).sum(dim=1)


def accept_sampled(
    draft_ids: Sequence[int],
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    generator: torch.Generator | None,
) -> tuple[list[int], int]:
    """Rejection sampling of one request's chain.

    draft_ids [k]; draft_probs [k, vocab] the q each draft was drawn from; target_probs
    [k + 1, vocab] the target's p at each verified position. Returns the emitted tokens
    (accepted drafts, then one drawn token) and how many drafts were accepted.
    """
    out: list[int] = []
    for i, d in enumerate(draft_ids):
        p, q = float(target_probs[i, d]), float(draft_probs[i, d])
        if uniform(generator, target_probs.device) * q < p:  # u < p / q, with q > 0
            out.append(d)
            continue
        residual = (target_probs[i] - draft_probs[i]).clamp(min=0)
        if not float(residual.sum()) > 0:  # p == q up to rounding: p itself
            residual = target_probs[i]
        out.append(draw(residual, generator))
        return out, i
    out.append(draw(target_probs[len(draft_ids)], generator))
    return out, len(draft_ids)
