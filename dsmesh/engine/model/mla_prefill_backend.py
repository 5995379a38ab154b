"""MLA prefill attention backends: the new tokens of prefill (and chunked-prefill) requests
attend their whole context, causally, with the latents expanded to per-head K and V (naive
MLA). Chosen once at engine start, beside the decode backend
(dsmesh/engine/model/mla_decode_backend.py):

- :class:`TorchMLAPrefill`: the reference, one request at a time
  (:meth:`dsmesh.engine.model.mla.MLAttention.attend_naive`, or ``attend_absorbed`` in "absorbed"
  mode);
- :class:`TritonMLAPrefill`: one launch over the ragged batch (dsmesh.kernels.mla_prefill).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from torch import nn

from dsmesh.engine.kv.pool import MLAKVPool
from dsmesh.engine.model.forward_batch import ForwardBatch, host_to_device


class MLALayer(Protocol):
    """What a prefill backend reads of the attention layer it serves
    (:class:`dsmesh.engine.model.mla.MLAttention`): its KV pool layer, shapes, the latent's
    up-projection to per-head K and V, and the reference attention over one request's
    context (q_nope [n, H, nope], q_pe [n, H, rope], ctx [S, kv_lora + rope], the
    request's prefix length -> [n, H, v])."""

    layer_idx: int
    num_heads: int
    nope_dim: int
    rope_dim: int
    v_dim: int
    kv_lora_rank: int
    scale: float
    kv_b_proj: nn.Linear

    def attend_naive(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, ctx: torch.Tensor, prefix: int
    ) -> torch.Tensor: ...

    def attend_absorbed(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, ctx: torch.Tensor, prefix: int
    ) -> torch.Tensor: ...


class MLAPrefillBackend(ABC):
    """Contract: for each request index in ``requests`` (ascending), the rows of its new
    tokens in ``out`` [T, H, v] become its causal attention over its context
    (``batch.kv_slots[i]``, already holding the new tokens' latents). ``q_nope`` [T, H, nope]
    and ``q_pe`` [T, H, rope] (roped) are the whole batch's queries; other rows of ``out``
    are left alone. The context is read through ``kv_pool.read`` (an FP8 pool's
    dequantised values), new tokens included."""

    name: str

    @abstractmethod
    def forward(
        self,
        attn: MLALayer,
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
        from dsmesh.kernels.backends import choose
        from dsmesh.kernels.mla_prefill import mla_prefill  # Triton is imported here, once

        choose("mla_prefill")  # logs once which backend runs
        self._kernel = mla_prefill
        self._reference = TorchMLAPrefill()

    def forward(self, attn, q_nope, q_pe, kv_pool, batch, requests, out, absorbed=False):
        if absorbed:
            self._reference.forward(attn, q_nope, q_pe, kv_pool, batch, requests, out, True)
            return
        key = ("triton_mla_prefill", tuple(requests))
        plan = batch.plans.get(key)
        if plan is None:  # the first layer plans; the others reuse it
            plan = batch.plans[key] = _RaggedPlan.of(batch, requests, q_nope.device)
        index = plan.rows
        ctx = kv_pool.read(attn.layer_idx, plan.slots)
        if ctx.dtype != q_nope.dtype:
            ctx = ctx.to(q_nope.dtype)
        latent, k_pe = ctx.split([attn.kv_lora_rank, attn.rope_dim], dim=-1)
        kv = attn.kv_b_proj(latent).view(-1, attn.num_heads, attn.nope_dim + attn.v_dim)
        k_nope, v = kv.split([attn.nope_dim, attn.v_dim], dim=-1)
        res = self._kernel(
            q_nope if index is None else q_nope.index_select(0, index),
            q_pe if index is None else q_pe.index_select(0, index),
            k_nope,
            k_pe,
            v,
            plan.cu_q,
            plan.cu_k,
            attn.scale,
            plan.max_q,
            out=out if index is None else None,  # every row: the kernel writes in place
        )
        if index is not None:
            out.index_copy_(0, index, res)


@dataclass(frozen=True)
class _RaggedPlan:
    """The chosen requests of one forward as the ragged kernel reads them, the same in
    every layer: their rows (None: every row of the batch), context slots and cumulative
    query / key lengths [n + 1] int32, all on the device."""

    rows: torch.Tensor | None
    slots: torch.Tensor
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int

    @classmethod
    def of(cls, batch: ForwardBatch, requests: list[int], device: torch.device) -> _RaggedPlan:
        extend = np.asarray(batch.extend_lens, dtype=np.int64)
        starts = np.concatenate([[0], np.cumsum(extend)[:-1]])
        chosen = np.asarray(requests, dtype=np.int64)
        q_lens = extend[chosen]
        k_lens = np.asarray(batch.prefix_lens, dtype=np.int64)[chosen] + q_lens
        cu = np.zeros((2, len(chosen) + 1), dtype=np.int32)
        cu[0, 1:], cu[1, 1:] = np.cumsum(q_lens), np.cumsum(k_lens)
        rows = None
        if len(requests) != batch.num_requests:
            index = np.repeat(starts[chosen] - np.cumsum(q_lens) + q_lens, q_lens)
            rows = host_to_device(index + np.arange(int(q_lens.sum())), device)
        cu_dev = host_to_device(cu, device)
        slots = torch.cat([batch.kv_slots[i] for i in requests])
        return cls(rows, slots, cu_dev[0], cu_dev[1], int(q_lens.max()))


def make_prefill_backend(triton: bool) -> MLAPrefillBackend:
    return TritonMLAPrefill() if triton else TorchMLAPrefill()
