"""MLA prefill attention over a ragged batch, including each request's cached prefix
(chunked prefill), on the naive path: K/V already expanded from the latents by ``kv_b_proj``.

Request ``b`` has ``q_len = cu_q[b+1] - cu_q[b]`` new tokens and ``k_len = cu_k[b+1] - cu_k[b]``
context tokens (its cached prefix, then the new tokens), so new token ``i`` sits at position
``k_len - q_len + i`` and sees context tokens ``j <= k_len - q_len + i``. The query and key are
split into the no-rope part (per head) and the rope part (``k_pe`` shared by all heads), so the
rope key is never broadcast in memory. One Triton launch (flash attention, online softmax)
covers the whole batch; :func:`mla_prefill_ref` is the torch reference.
"""

from __future__ import annotations

import functools
import math

import torch

from dsmesh.kernels._triton import can_launch, next_pow2

__all__ = ["mla_prefill", "mla_prefill_ref"]

_LOG2E = 1.4426950408889634


def mla_prefill_ref(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    k_nope: torch.Tensor,
    k_pe: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q_nope [T, H, D], q_pe [T, H, R], k_nope [S, H, D], k_pe [S, R], v [S, H, V],
    cu_q [B+1], cu_k [B+1] -> [T, H, V]; float32 softmax, one request at a time."""
    out = q_nope.new_empty((q_nope.shape[0], q_nope.shape[1], v.shape[-1]))
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for b in range(len(cq) - 1):
        qs, qe, ks, ke = cq[b], cq[b + 1], ck[b], ck[b + 1]
        n, s = qe - qs, ke - ks
        if n == 0:
            continue
        scores = torch.einsum("nhd,shd->hns", q_nope[qs:qe].float(), k_nope[ks:ke].float())
        scores = scores + torch.einsum("nhr,sr->hns", q_pe[qs:qe].float(), k_pe[ks:ke].float())
        q_pos = torch.arange(n, device=q_nope.device)[:, None] + (s - n)
        k_pos = torch.arange(s, device=q_nope.device)[None, :]
        scores = (scores * scale).masked_fill(k_pos > q_pos, float("-inf"))
        probs = scores.softmax(dim=-1)
        out[qs:qe] = torch.einsum("hns,shv->nhv", probs, v[ks:ke].float()).to(out.dtype)
    return out


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def prefill_kernel(
        qn_ptr,
        qp_ptr,
        kn_ptr,
        kp_ptr,
        v_ptr,
        o_ptr,
        cu_q_ptr,
        cu_k_ptr,
        s_qn_t,
        s_qn_h,
        s_qp_t,
        s_qp_h,
        s_kn_t,
        s_kn_h,
        s_kp_t,
        s_v_t,
        s_v_h,
        s_o_t,
        s_o_h,
        qk_scale,
        D: tl.constexpr,
        R: tl.constexpr,
        DV: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_DV: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        b = tl.program_id(1)
        h = tl.program_id(2)
        q_start = tl.load(cu_q_ptr + b)
        q_len = tl.load(cu_q_ptr + b + 1) - q_start
        if pid_m * BLOCK_M < q_len:
            k_start = tl.load(cu_k_ptr + b)
            k_len = tl.load(cu_k_ptr + b + 1) - k_start
            prefix = k_len - q_len
            rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
            rmask = rows < q_len
            qrow = (q_start + rows).to(tl.int64)
            d = tl.arange(0, BLOCK_D)
            r = tl.arange(0, BLOCK_R)
            dv = tl.arange(0, BLOCK_DV)
            q = tl.load(
                qn_ptr + qrow[:, None] * s_qn_t + h * s_qn_h + d[None, :],
                mask=rmask[:, None] & (d < D)[None, :],
                other=0.0,
            )
            qp = tl.load(
                qp_ptr + qrow[:, None] * s_qp_t + h * s_qp_h + r[None, :],
                mask=rmask[:, None] & (r < R)[None, :],
                other=0.0,
            )
            m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
            l_i = tl.zeros((BLOCK_M,), tl.float32)
            acc = tl.zeros((BLOCK_M, BLOCK_DV), tl.float32)
            end = tl.minimum(k_len, prefix + (pid_m + 1) * BLOCK_M)
            for n0 in range(0, end, BLOCK_N):
                cols = n0 + tl.arange(0, BLOCK_N)
                cmask = cols < k_len
                krow = (k_start + cols).to(tl.int64)
                k = tl.load(
                    kn_ptr + krow[:, None] * s_kn_t + h * s_kn_h + d[None, :],
                    mask=cmask[:, None] & (d < D)[None, :],
                    other=0.0,
                )
                kp = tl.load(
                    kp_ptr + krow[:, None] * s_kp_t + r[None, :],
                    mask=cmask[:, None] & (r < R)[None, :],
                    other=0.0,
                )
                vv = tl.load(
                    v_ptr + krow[:, None] * s_v_t + h * s_v_h + dv[None, :],
                    mask=cmask[:, None] & (dv < DV)[None, :],
                    other=0.0,
                )
                s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
                s = tl.dot(qp, tl.trans(kp), acc=s, input_precision=PRECISION)
                ok = cmask[None, :] & (cols[None, :] <= prefix + rows[:, None])
                s = tl.where(ok, s * qk_scale, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, axis=1))
                p = tl.exp2(s - m_new[:, None])
                alpha = tl.exp2(m_i - m_new)
                l_i = l_i * alpha + tl.sum(p, axis=1)
                acc = tl.dot(
                    p.to(vv.dtype), vv, acc=acc * alpha[:, None], input_precision=PRECISION
                )
                m_i = m_new
            res = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            tl.store(
                o_ptr + qrow[:, None] * s_o_t + h * s_o_h + dv[None, :],
                res.to(o_ptr.dtype.element_ty),
                mask=rmask[:, None] & (dv < DV)[None, :],
            )

    return prefill_kernel


_DEFAULT_CONFIG = {"block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 2}


def mla_prefill(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    k_nope: torch.Tensor,
    k_pe: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    scale: float,
    max_q_len: int,
    out: torch.Tensor | None = None,
    config: dict | None = None,
) -> torch.Tensor:
    """Same contract as :func:`mla_prefill_ref`; ``max_q_len`` (the longest request's new
    tokens, a host int) sizes the grid. Inputs may be strided views (last dim contiguous)."""
    t, h, d = q_nope.shape
    r, dv = q_pe.shape[-1], v.shape[-1]
    if k_nope.shape[1:] != (h, d) or v.shape[1] != h or k_pe.shape[-1] != r:
        raise ValueError(
            f"k_nope {tuple(k_nope.shape)}, k_pe {tuple(k_pe.shape)} and v {tuple(v.shape)} "
            f"do not match q_nope {tuple(q_nope.shape)} and q_pe {tuple(q_pe.shape)}"
        )
    if cu_q.shape != cu_k.shape or cu_q.dim() != 1:
        raise ValueError(f"cu_q {tuple(cu_q.shape)} and cu_k {tuple(cu_k.shape)} must be [B+1]")
    if not can_launch(q_nope):
        raise RuntimeError("mla_prefill needs a CUDA tensor (or TRITON_INTERPRET=1)")
    if any(x.stride(-1) != 1 for x in (q_nope, q_pe, k_nope, k_pe, v)):
        raise ValueError("mla_prefill needs unit stride in the last dimension")
    if out is None:
        out = torch.empty((t, h, dv), dtype=q_nope.dtype, device=q_nope.device)
    batch = cu_q.shape[0] - 1
    if t == 0 or batch == 0 or max_q_len == 0:
        return out
    cfg = dict(_DEFAULT_CONFIG, **(config or {}))
    block_m = min(cfg["block_m"], max(16, next_pow2(max_q_len)))
    grid = (math.ceil(max_q_len / block_m), batch, h)
    _kernels()[grid](
        q_nope,
        q_pe,
        k_nope,
        k_pe,
        v,
        out,
        cu_q,
        cu_k,
        q_nope.stride(0),
        q_nope.stride(1),
        q_pe.stride(0),
        q_pe.stride(1),
        k_nope.stride(0),
        k_nope.stride(1),
        k_pe.stride(0),
        v.stride(0),
        v.stride(1),
        out.stride(0),
        out.stride(1),
        scale * _LOG2E,
        D=d,
        R=r,
        DV=dv,
        BLOCK_D=max(16, next_pow2(d)),
        BLOCK_R=max(16, next_pow2(r)),
        BLOCK_DV=max(16, next_pow2(dv)),
        BLOCK_M=block_m,
        BLOCK_N=cfg["block_n"],
        PRECISION="ieee" if q_nope.dtype == torch.float32 else "tf32",
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    return out
