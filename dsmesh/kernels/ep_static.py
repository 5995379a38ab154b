"""Fixed-capacity send buffers for expert parallelism's static all-to-all (CUDA graphs).

Each rank sends every rank ``cap = T * k`` rows (room for all its pairs), so shapes are known
on the host. Row ``dest * cap + i`` of the send buffer holds the ``i``-th pair (in flat
``t * k + j`` order) routed to rank ``dest``: its token's hidden state, then its local expert
id as int64 in the first 8 bytes of the last :data:`ID_COLUMNS` columns (:func:`ids_of`);
rows no pair fills carry id -1 (padding). That slot is what a stable sort of the pairs by
destination rank gives, computed here without sorting: ``dest * cap`` plus the number of
earlier pairs with the same destination.

:func:`pack_static` does it in one Triton launch; :func:`pack_static_ref` is the torch
reference. The way back, ``out[t] = sum_j w[t, j] * back[slot[t * k + j]]``, is
:func:`dsmesh.kernels.moe_gemm.gather_combine`.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from dsmesh.kernels._triton import can_launch, next_pow2

__all__ = ["id_columns", "ids_of", "pack_static", "pack_static_ref"]


# Columns after a row's hidden state: its int64 expert id in the first 8 bytes (any dtype of
# 1-4 bytes), and a row stride that stays a multiple of 16 elements when the hidden size is,
# so the expert kernels reading the received rows in place keep their vectorised loads (with
# 8 bytes only, bf16 rows of 2,052 elements halved the fused MoE's speed on an H200).
ID_COLUMNS = 16


def id_columns(dtype: torch.dtype) -> int:
    """How many columns of ``dtype`` follow a row's hidden state (its expert id and padding)."""
    del dtype  # the same for every dtype: see ID_COLUMNS
    return ID_COLUMNS


def ids_of(rows: torch.Tensor) -> torch.Tensor:
    """The int64 ids carried after the hidden state of each row of ``rows`` [N, H + extra], as a
    view [N] (writes go through to ``rows``)."""
    extra = id_columns(rows.dtype)
    return rows[:, rows.shape[1] - extra :].view(torch.int64)[:, 0]


def _check(hidden: torch.Tensor, physical_ids: torch.Tensor) -> None:
    if hidden.dim() != 2 or physical_ids.dim() != 2 or physical_ids.shape[0] != hidden.shape[0]:
        raise ValueError(
            f"hidden {tuple(hidden.shape)} and physical_ids {tuple(physical_ids.shape)} "
            "must be [T, H] and [T, k]"
        )
    if hidden.shape[1] * hidden.element_size() % 8:
        raise ValueError(f"a row of {hidden.shape[1]} {hidden.dtype} is not a whole 8 bytes")


def pack_static_ref(
    hidden: torch.Tensor, physical_ids: torch.Tensor, num_local: int, ep_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden [T, H]; physical_ids [T, k] int (physical expert ``p`` lives on rank
    ``p // num_local`` as local expert ``p % num_local``) -> (send [ep_size * T * k,
    H + extra] in hidden's dtype, slot [T * k] int64: the send row of each flat pair).
    Padding rows' hidden columns are left uninitialised."""
    _check(hidden, physical_ids)
    num_tokens, top_k = physical_ids.shape
    cap = num_tokens * top_k
    h = hidden.shape[1]
    flat = physical_ids.reshape(-1).to(torch.int64)
    dest = flat // num_local
    onehot = F.one_hot(dest, ep_size)  # [P, ep_size]
    earlier = (onehot.cumsum(0) - onehot).gather(1, dest[:, None])[:, 0]
    slot = dest * cap + earlier
    send = hidden.new_empty((ep_size * cap, h + id_columns(hidden.dtype)))
    ids = ids_of(send)
    ids.fill_(-1)
    ids.index_copy_(0, slot, flat % num_local)
    pairs = torch.arange(cap, device=hidden.device)
    send[:, :h].index_copy_(0, slot, hidden.index_select(0, pairs // top_k))
    return send, slot


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def pack_kernel(
        x_ptr, ids_ptr, send_ptr, send_ids_ptr, slot_ptr, n_pairs, num_local, cap, hidden,
        stride_x, stride_s, stride_sid,
        TOP_K: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_H: tl.constexpr,
    ):  # fmt: skip
        # Expert ids fit int32: its division is far cheaper than int64's.
        pid = tl.program_id(0)
        lanes = tl.arange(0, BLOCK_P)
        if pid < n_pairs:  # one pair: its slot, its id, its row
            e = tl.load(ids_ptr + pid).to(tl.int32)
            dest = e // num_local
            earlier = tl.sum(tl.zeros([BLOCK_P], tl.int32), axis=0)
            for c in range(0, pid, BLOCK_P):
                offs = c + lanes
                mask = offs < pid
                other = tl.load(ids_ptr + offs, mask=mask, other=0).to(tl.int32)
                earlier += tl.sum((mask & (other // num_local == dest)).to(tl.int32), axis=0)
            slot = dest.to(tl.int64) * cap + earlier
            tl.store(slot_ptr + pid, slot)
            tl.store(send_ids_ptr + slot * stride_sid, (e - dest * num_local).to(tl.int64))
            src = x_ptr + (pid // TOP_K).to(tl.int64) * stride_x
            dst = send_ptr + slot * stride_s
            for c in range(0, hidden, BLOCK_H):
                cols = c + tl.arange(0, BLOCK_H)
                cmask = cols < hidden
                tl.store(dst + cols, tl.load(src + cols, mask=cmask), mask=cmask)
        else:  # one destination rank: id -1 on the rows past its pairs
            d = pid - n_pairs
            count = tl.sum(tl.zeros([BLOCK_P], tl.int32), axis=0)
            for c in range(0, n_pairs, BLOCK_P):
                offs = c + lanes
                mask = offs < n_pairs
                other = tl.load(ids_ptr + offs, mask=mask, other=0).to(tl.int32)
                count += tl.sum((mask & (other // num_local == d)).to(tl.int32), axis=0)
            pad = tl.full([BLOCK_P], -1, tl.int64)
            first = d.to(tl.int64) * cap
            for c in range(0, cap, BLOCK_P):
                rows = c + lanes
                rmask = (rows >= count) & (rows < cap)
                tl.store(send_ids_ptr + (first + rows) * stride_sid, pad, mask=rmask)

    return pack_kernel


def pack_static(
    hidden: torch.Tensor, physical_ids: torch.Tensor, num_local: int, ep_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`pack_static_ref` in one launch: a program per pair counts the earlier pairs with
    its destination (its slot) and copies its token's row; a program per destination rank
    marks that rank's rows past its pairs as padding. Physical ids must be in
    ``[0, ep_size * num_local)``."""
    _check(hidden, physical_ids)
    if not can_launch(hidden):
        raise RuntimeError("pack_static needs a CUDA tensor (or TRITON_INTERPRET=1)")
    num_tokens, top_k = physical_ids.shape
    cap = num_tokens * top_k
    h = hidden.shape[1]
    send = hidden.new_empty((ep_size * cap, h + id_columns(hidden.dtype)))
    slot = torch.empty(cap, dtype=torch.int64, device=hidden.device)
    if cap == 0:
        return send, slot
    x = hidden if hidden.stride(1) == 1 else hidden.contiguous()
    ids = physical_ids.contiguous()
    send_ids = ids_of(send)
    _kernel()[(cap + ep_size,)](
        x, ids, send, send_ids, slot, cap, num_local, cap, h,
        x.stride(0), send.stride(0), send_ids.stride(0),
        TOP_K=top_k, BLOCK_P=min(max(next_pow2(cap), 16), 1024),
        BLOCK_H=min(next_pow2(h), 1024),
    )  # fmt: skip
    return send, slot
