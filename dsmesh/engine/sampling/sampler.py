"""Next-token sampling: logit adjustments, greedy, temperature, top-k, top-p and min-p,
reproducible per request, with the log-probabilities a request asks for."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dsmesh.engine.sampling.logits_adjust import adjust_logits, mask_tokens, min_tokens_bans
from dsmesh.engine.sampling.params import SamplingParams
from dsmesh.engine.sampling.token_logprobs import TokenLogprobs
from dsmesh.engine.sampling.token_mask import apply_token_bitmask

GREEDY_BELOW = 1e-5


@dataclass(frozen=True)
class SamplerOutput:
    """token_ids [batch] int64 on the logits' device; ``logprobs[i]`` for the rows whose
    params ask for logprobs (None for the others), or None when no row asks."""

    token_ids: torch.Tensor
    logprobs: list[TokenLogprobs | None] | None = None


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator | None:
    """A generator on ``device`` seeded with ``seed``, or None (use the default RNG) if unseeded.

    The caller keeps one per request for its whole life, so a request's draws advance only its
    own generator.
    """
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def advance_generator(generator: torch.Generator, steps: int) -> None:
    """Consume ``steps`` sampling draws, as if this request had sampled that many tokens
    here; used when an earlier token was sampled elsewhere (the first token on prefill)."""
    for _ in range(steps):
        torch.rand(1, generator=generator, device=generator.device)


class Sampler:
    """Samples one token per row of a logits batch; stateless, so one instance serves all.

    Semantics follow vLLM: rows with ``temperature == 0`` take the argmax (ties go to the
    lowest id). Other rows divide by the temperature, keep the ``top_k`` largest logits, then
    the smallest set of tokens whose cumulative probability (renormalised over the top-k
    survivors) reaches ``top_p``, then drop tokens whose probability is below
    ``min_p * max_prob``; the survivors are renormalised and one token is drawn by inverse CDF
    with a single uniform from the row's generator. Every filter keeps the most likely token.
    A row's token depends only on its own logits, parameters and generator, never on the other
    rows of the batch.

    Before any of that, rows with a logit bias or a penalty get their logits adjusted
    (dsmesh/engine/sampling/logits_adjust.py); greedy rows then take the argmax of the adjusted
    logits. Rows that ask for logprobs get them from the raw logits (see :class:`TokenLogprobs`), as
    vLLM reports them by default. Rows below their ``min_tokens`` cannot sample ``eos_token_ids``
    (unless they ignore EOS) or their stop token ids.
    """

    def __init__(self, eos_token_ids: Sequence[int] = ()) -> None:
        self.eos_token_ids = tuple(eos_token_ids)

    def __call__(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
        prompt_ids: Sequence[Sequence[int]] | None = None,
        output_ids: Sequence[Sequence[int]] | None = None,
        allowed: torch.Tensor | None = None,
    ) -> SamplerOutput:
        """logits [batch, vocab] (any float dtype) -> the tokens of every row, and logprobs.

        ``params[i]`` and ``generators[i]`` belong to row i; a None generator draws from the
        default RNG of the logits' device. Greedy rows draw nothing. ``prompt_ids[i]`` and
        ``output_ids[i]`` are row i's request's tokens so far, needed only when a row has a
        penalty (read, never kept). ``allowed`` [batch, ceil(vocab / 32)] int32 (any device) is
        a bitmask of the tokens each row may take (dsmesh/engine/sampling/token_mask.py; all bits
        set for a free row), applied after every other adjustment, to greedy and sampled rows alike.
        """
        if logits.dim() != 2:
            raise ValueError(f"logits must be [batch, vocab], got shape {tuple(logits.shape)}")
        batch = logits.shape[0]
        if len(params) != batch or len(generators) != batch:
            raise ValueError(
                f"need one SamplingParams and one generator per row: batch={batch}, "
                f"len(params)={len(params)}, len(generators)={len(generators)}"
            )
        adjusted = logits
        if any(p.adjusts_logits for p in params):
            if any(p.has_penalties for p in params) and (prompt_ids is None or output_ids is None):
                raise ValueError("penalties need every row's prompt_ids and output_ids")
            adjusted = adjust_logits(
                logits, params, prompt_ids or [()] * batch, output_ids or [()] * batch
            )
        if any(p.min_tokens > 0 for p in params):
            if output_ids is None:
                raise ValueError("min_tokens needs every row's output_ids")
            adjusted = mask_tokens(
                adjusted, min_tokens_bans(params, output_ids, self.eos_token_ids)
            )
        if allowed is not None:  # structured outputs: the grammar's tokens only, last
            adjusted = apply_token_bitmask(adjusted, allowed)
        token_ids = self._choose(adjusted, params, generators)
        logprobs = None
        if any(p.logprobs is not None for p in params):
            logprobs = token_logprobs(logits, token_ids, params)
        return SamplerOutput(token_ids, logprobs)

    def _choose(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
    ) -> torch.Tensor:
        """logits [batch, vocab] -> token ids [batch] int64: argmax or a draw per row."""
        batch = logits.shape[0]
        device = logits.device
        if all(p.temperature < GREEDY_BELOW for p in params):
            return logits.argmax(dim=-1)  # all greedy (the common decode batch): one kernel
        token_ids = torch.empty(batch, dtype=torch.int64, device=device)
        # Temperatures below GREEDY_BELOW would divide float32 logits by ~0: greedy, as vLLM.
        greedy_rows = [i for i, p in enumerate(params) if p.temperature < GREEDY_BELOW]
        sampled_rows = [i for i, p in enumerate(params) if p.temperature >= GREEDY_BELOW]
        if greedy_rows:
            rows = torch.tensor(greedy_rows, dtype=torch.int64, device=device)
            token_ids[rows] = logits[rows].argmax(dim=-1)
        if sampled_rows:
            rows = torch.tensor(sampled_rows, dtype=torch.int64, device=device)
            token_ids[rows] = _sample(
                logits[rows].float(),
                [params[i] for i in sampled_rows],
                [generators[i] for i in sampled_rows],
            )
        return token_ids


def token_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, params: Sequence[SamplingParams]
) -> list[TokenLogprobs | None]:
    """Logprobs of ``token_ids`` [batch] and of each row's ``params[i].logprobs`` most likely
    tokens, from the raw logits [batch, vocab]; None for rows that ask for none."""
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
    logprobs = torch.log_softmax(logits.index_select(0, index).float(), dim=-1)  # [r, vocab]
    chosen_ids = token_ids.index_select(0, index)
    chosen = logprobs.gather(1, chosen_ids.unsqueeze(1)).squeeze(1)
    k = min(max(params[i].logprobs or 0 for i in rows), logprobs.shape[1])
    top_values, top_ids = logprobs.topk(k, dim=-1)  # k == 0 gives [r, 0]
    # One copy to the host: float64 holds every token id and float32 logprob exactly.
    table = torch.cat(
        [
            chosen_ids[:, None].double(),
            chosen[:, None].double(),
            top_ids.double(),
            top_values.double(),
        ],
        dim=1,
    ).tolist()
    out: list[TokenLogprobs | None] = [None] * len(params)
    for row, i in zip(table, rows, strict=True):
        want = params[i].logprobs or 0
        top = tuple(
            (int(t), v) for t, v in zip(row[2 : 2 + want], row[2 + k : 2 + k + want], strict=True)
        )
        out[i] = TokenLogprobs(int(row[0]), row[1], top)
    return out


def _sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> torch.Tensor:
    """logits [n, vocab] float32 of non-greedy rows -> token ids [n] int64."""
    device = logits.device
    vocab = logits.shape[1]
    temperature = torch.tensor([p.temperature for p in params], device=device)
    scaled = logits / temperature.unsqueeze(1)

    keep: torch.Tensor | None = None  # [n, vocab] bool; None keeps everything
    use_top_k = any(0 < p.top_k < vocab for p in params)
    use_top_p = any(p.top_p < 1.0 for p in params)
    if use_top_k or use_top_p:
        keep = _top_k_top_p_mask(scaled, params, use_top_k, use_top_p)
    if any(p.min_p > 0.0 for p in params):
        # p_i >= min_p * p_max  <=>  z_i >= z_max + log(min_p); log(0) = -inf keeps all.
        log_min_p = torch.tensor(
            [math.log(p.min_p) if p.min_p > 0 else -math.inf for p in params], device=device
        )
        min_p_keep = scaled >= scaled.amax(dim=-1, keepdim=True) + log_min_p.unsqueeze(1)
        keep = min_p_keep if keep is None else keep & min_p_keep
    if keep is not None:
        scaled = scaled.masked_fill(~keep, -math.inf)

    # Always draw in vocab order, so a row's token never depends on which filters other rows
    # switched on.
    probs = torch.softmax(scaled, dim=-1)
    cdf = torch.cumsum(probs, dim=-1)
    uniform = _draw_uniforms(generators, device)
    target = (uniform * cdf[:, -1]).unsqueeze(1)
    token_ids = torch.searchsorted(cdf, target, right=True).squeeze(1)
    # Rounding can put the target at or past the total mass; fall back to the last kept token.
    ids = torch.arange(vocab, device=device)
    last_kept = torch.where(probs > 0, ids, -1).amax(dim=-1)
    # No positive probability at all (a NaN row): fall back to the argmax, never to -1.
    last_kept = torch.where(last_kept < 0, logits.argmax(dim=-1), last_kept)
    return torch.minimum(token_ids, last_kept)


def _top_k_top_p_mask(
    scaled: torch.Tensor, params: Sequence[SamplingParams], use_top_k: bool, use_top_p: bool
) -> torch.Tensor:
    """Keep-mask [n, vocab] bool of top-k then top-p over temperature-scaled logits [n, vocab].

    Both filters keep a prefix of the descending sort, so they are applied in sorted order and
    scattered back. A stable sort sends ties to the lowest id, matching argmax.
    """
    n, vocab = scaled.shape
    device = scaled.device
    sorted_logits, sorted_ids = torch.sort(scaled, dim=-1, descending=True, stable=True)
    positions = torch.arange(vocab, device=device).unsqueeze(0)
    sorted_keep = torch.ones(n, vocab, dtype=torch.bool, device=device)
    if use_top_k:
        top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=device)
        sorted_keep = positions < top_k.unsqueeze(1)
    if use_top_p:
        # Rows with top_p == 1 get an infinite threshold so rounding can never drop a token.
        top_p = torch.tensor(
            [p.top_p if p.top_p < 1.0 else math.inf for p in params], device=device
        )
        sorted_probs = torch.softmax(sorted_logits.masked_fill(~sorted_keep, -math.inf), dim=-1)
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        sorted_keep = sorted_keep & (mass_before < top_p.unsqueeze(1))
        sorted_keep[:, 0] = True  # the most likely token survives any top_p, however small
    return torch.zeros_like(sorted_keep).scatter(1, sorted_ids, sorted_keep)


def _draw_uniforms(
    generators: Sequence[torch.Generator | None], device: torch.device
) -> torch.Tensor:
    """One uniform in [0, 1) per row [n] float32, each from that row's generator.

    Rows without a generator share one draw call on the default RNG.
    """
    uniforms = torch.empty(len(generators), dtype=torch.float32, device=device)
    unseeded_rows = [i for i, g in enumerate(generators) if g is None]
    if unseeded_rows:
        rows = torch.tensor(unseeded_rows, dtype=torch.int64, device=device)
        uniforms[rows] = torch.rand(len(unseeded_rows), device=device)
    for i, generator in enumerate(generators):
        if generator is not None:
            draw = torch.rand(1, generator=generator, device=generator.device)
            uniforms[i] = draw.to(device)[0]
    return uniforms
