"""MLA prefill attention backends: the new tokens of prefill (and chunked-prefill) requests
attend their whole context, causally, with the latents expanded to per-head K and V (naive
MLA). Chosen once at engine start, beside the decode backend (engine/mla_decode_backend.py):

- :class:`TorchMLAPrefill`: the reference, one request at a time
  (:meth:`engine.mla.MLAttention.attend_naive`, or ``attend_absorbed`` in "absorbed" mode);
- :class:`TritonMLAPrefill`: one launch over the ragged batch (kernels.mla_prefill).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

from engine.forward_batch import ForwardBatch
from engine.kv_cache import MLAKVPool

if TYPE_CHECKING:
    from engine.mla import MLAttention


class MLAPrefillBackend(ABC):
    """Contract: for each request index in ``requests`` (ascending), the rows of its new
    tokens in ``out`` [T, H, v] become its causal attention over its context
    (``batch.kv_slots[i]``, already holding the new tokens' latents). ``q_nope`` [T, H, nope]
    and ``q_pe`` [T, H, rope] (roped) are the whole batch's queries; other rows of ``out``
    are left alone."""

    name: str

    @abstractmethod
    def forward(
        self,
        attn: MLAttention,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        kv_pool: MLAKVPool,
        batch: ForwardBatch,
        requests: list[int],
        out: torch.Tensor,
        absorbed: bool = False,
    ) -> None: ...


class TorchMLAPrefill(MLAPrefillBackend):
    """``absorbed`` attends over the latents directly (the "absorbed" attention mode)."""

    name = "torch"

    def forward(self, attn, q_nope, q_pe, kv_pool, batch, requests, out, absorbed=False):
        starts = [0]
        for n in batch.extend_lens:
            starts.append(starts[-1] + n)
        attend = attn.attend_absorbed if absorbed else attn.attend_naive
        for i in requests:
            rows = slice(starts[i], starts[i + 1])
            ctx = kv_pool.read(attn.layer_idx, batch.kv_slots[i]).to(q_nope.dtype)
            out[rows] = attend(q_nope[rows], q_pe[rows], ctx, batch.prefix_lens[i])


class TritonMLAPrefill(MLAPrefillBackend):
    """Naive attention for every chosen request in one Triton launch over the ragged batch;
    "absorbed" mode falls back to the reference."""

    name = "triton"

    def __init__(self) -> None:
        from kernels.backends import choose
        from kernels.mla_prefill import mla_prefill  # Triton is imported here, once

        choose("mla_prefill")  # logs once which backend runs
        self._kernel = mla_prefill
        self._reference = TorchMLAPrefill()

    def forward(self, attn, q_nope, q_pe, kv_pool, batch, requests, out, absorbed=False):
        if absorbed:
            self._reference.forward(attn, q_nope, q_pe, kv_pool, batch, requests, out, True)
            return
        rows, q_lens, k_lens = [], [], []
        start = 0
        chosen = set(requests)
        for i, n in enumerate(batch.extend_lens):
            if i in chosen:
                rows.append(torch.arange(start, start + n))
                q_lens.append(n)
                k_lens.append(batch.prefix_lens[i] + n)
            start += n
        device = q_nope.device
        every_row = len(requests) == batch.num_requests
        index = None if every_row else torch.cat(rows).to(device)
        ctx = kv_pool.read(attn.layer_idx, torch.cat([batch.kv_slots[i] for i in requests]))
        latent, k_pe = ctx.to(q_nope.dtype).split([attn.kv_lora_rank, attn.rope_dim], dim=-1)
        kv = attn.kv_b_proj(latent).view(-1, attn.num_heads, attn.nope_dim + attn.v_dim)
        k_nope, v = kv.split([attn.nope_dim, attn.v_dim], dim=-1)
        cu = torch.tensor([[0, 0], *zip(q_lens, k_lens, strict=True)]).cumsum(0)
        cu = cu.to(device=device, dtype=torch.int32)
        res = self._kernel(
            q_nope if index is None else q_nope.index_select(0, index),
            q_pe if index is None else q_pe.index_select(0, index),
            k_nope,
            k_pe,
            v,
            cu[:, 0].contiguous(),
            cu[:, 1].contiguous(),
            attn.scale,
            max(q_lens),
        )
        if index is None:
            out.copy_(res)
        else:
            out.index_copy_(0, index, res)


def make_prefill_backend(triton: bool) -> MLAPrefillBackend:
    return TritonMLAPrefill() if triton else TorchMLAPrefill()
