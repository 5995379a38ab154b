"""MLA decode for many heads (DeepSeek-V3's 128): 64 heads per program, so the products are
warpgroup MMAs on Hopper.

Same contract and split-K layout as :func:`dsmesh.kernels.mla_decode.mla_decode`, which picks
this kernel from the shapes. One program attends one request's context piece for a block of
``BLOCK_H`` (64) heads:

    s   = q_latent[64, C] . kv_latent[BLOCK_N, C]^T + q_pe[64, R] . kv_rope[BLOCK_N, R]^T
    acc = acc * alpha + p[64, BLOCK_N] . kv_latent[BLOCK_N, C]

With 64 query rows each ``tl.dot`` has M = 64, which Triton lowers to ``wgmma`` on sm_90; with 8
warps (two warpgroups) Triton splits the columns of both products over the warpgroups, so the
[64, 512] float32 accumulator is 128 registers a thread (the value dimension cut in two, as
FlashMLA does). The 16-row kernel it replaces for many heads read each request's cache once per
16 heads; here it is once per 64 (twice at 128 heads, the second time mostly from L2: the two
head blocks of a request are neighbours in the grid).

Layouts. Triton 3.6 gives a product whose result feeds another product (its forward slice)
all warps along M (``warpsPerCTA = [8, 1]``); with M = 64 that repeats the score product in
both warpgroups, about half the FLOPs done twice. Two things keep the scores split by columns
(``[4, 2]``), checked by compiling for sm_90a offline (32-token tiles: 38 wgmma in the
PTX, 70 with the chain): the latent and rope scores are two products, each scaled and then
summed (Triton folds ``dot + x`` into ``dot(acc=x)``, a chain); and the value product's
operands (p and the rescaled accumulator) come out of an always-true ``if``, whose results the
slice does not follow. The row max and sum then cross the warpgroups through shared memory,
and so does p.

FP8 cache (``FP8``): ``kv`` holds float8_e4m3fn values and ``sc`` two float32 scales per token
(latent, rope). The tile is widened to the query's dtype in registers; the rope scale multiplies
the rope score, the latent scale the latent score and, folded into the probabilities, the
values (``out = sum_s p[s] * s_lat[s] * lat8[s]``).
"""

from __future__ import annotations

import functools
import math

__all__ = ["WIDE_BLOCK_H", "wide_config", "wide_kernel", "wide_num_splits"]

WIDE_BLOCK_H = 64


def wide_num_splits(batch: int, heads: int, max_context: int, num_sms: int) -> int:
    """Context pieces per (request, 64-head block): one wave of programs at most (a program
    holds most of a multiprocessor's shared memory, so one runs per SM and a half-filled
    second wave would cost a whole one), pieces of at least 64 tokens, at most 64 pieces.
    Shapes only (graph-safe)."""
    programs = batch * math.ceil(heads / WIDE_BLOCK_H)
    want = max(1, num_sms // programs)
    return max(1, min(want, math.ceil(max_context / 64), 64))


def wide_config(batch: int, heads: int, max_context: int, fp8: bool) -> dict:
    """Tile sizes for the 64-head kernel, a pure function of shapes. 64-token tiles: the score
    product is then 32 columns a warpgroup. In 16-bit, two deep: the query (72 KB) and two
    tiles of the cache (72 KB each) fill 224 KB of the H200's 227 KB of shared memory per
    program. An FP8 tile is half that but is widened into a 72 KB copy, so two FP8 tiles in
    flight take ``num_stages=5`` (the page-table loads hold their own stages). H200,
    2026-12-04, 128 heads, batch 128, 2000 tokens: 0.282 ms; 32-token tiles 0.448 (two deep)
    and 0.392 (three deep), one 64-token tile 0.375; FP8 0.376 against 0.385 one tile deep."""
    del batch, heads, max_context  # one choice per dtype today
    return {"block_n": 64, "num_warps": 8, "num_stages": 5 if fp8 else 2}


@functools.cache
def wide_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def partial_wide_kernel(
        q_ptr,
        qpe_ptr,
        kv_ptr,
        sc_ptr,
        pt_ptr,
        lens_ptr,
        o_ptr,
        lse_ptr,
        num_heads,
        stride_qb,
        stride_qh,
        stride_pb,
        stride_ph,
        stride_kv_page,
        stride_kv_tok,
        stride_sc_page,
        stride_sc_tok,
        stride_pt,
        stride_ob,
        stride_oh,
        stride_os,
        qk_scale,
        C: tl.constexpr,
        R: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_N: tl.constexpr,
        PAGE_SIZE: tl.constexpr,
        NUM_SPLITS: tl.constexpr,
        DIRECT: tl.constexpr,
        PRECISION: tl.constexpr,
        IN_PAGE: tl.constexpr,
        FP8: tl.constexpr,
    ):
        hb = tl.program_id(0)  # head blocks of one request are neighbours: its cache stays in L2
        b = tl.program_id(1)
        split = tl.program_id(2)
        seq_len = tl.load(lens_ptr + b)
        per_split = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
        start = split * per_split
        end = tl.minimum(start + per_split, seq_len)

        heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
        hmask = heads < num_heads
        c = tl.arange(0, C)
        r = tl.arange(0, R)
        q = tl.load(
            q_ptr + b * stride_qb + heads[:, None] * stride_qh + c[None, :],
            mask=hmask[:, None],
            other=0.0,
        )
        qpe = tl.load(
            qpe_ptr + b * stride_pb + heads[:, None] * stride_ph + r[None, :],
            mask=hmask[:, None],
            other=0.0,
        )
        if not FP8:  # products in the cache's dtype; an FP8 tile is widened to q's instead
            q = q.to(kv_ptr.dtype.element_ty)
            qpe = qpe.to(kv_ptr.dtype.element_ty)

        m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_H,), tl.float32)
        acc = tl.zeros((BLOCK_H, C), tl.float32)
        pt_row = pt_ptr + b.to(tl.int64) * stride_pt
        for n0 in range(start, end, BLOCK_N):
            pos = n0 + tl.arange(0, BLOCK_N)
            pmask = pos < end
            if IN_PAGE:  # the tile lies in one page: one page-id load
                page = tl.load(pt_row + n0 // PAGE_SIZE).to(tl.int64)
            else:
                page = tl.load(pt_row + pos // PAGE_SIZE, mask=pmask, other=0).to(tl.int64)
            tok = pos % PAGE_SIZE
            row = page * stride_kv_page + tok * stride_kv_tok
            k = tl.load(kv_ptr + row[:, None] + c[None, :], mask=pmask[:, None], other=0.0)
            kpe = tl.load(kv_ptr + row[:, None] + C + r[None, :], mask=pmask[:, None], other=0.0)
            if FP8:
                k = k.to(q.dtype)
                kpe = kpe.to(q.dtype)
            # Two products, scaled and summed: not chained (acc=), nor summed before scaling,
            # which Triton folds back into a chain (see "Layouts" in the module docstring).
            s_c = tl.dot(q, tl.trans(k), input_precision=PRECISION)
            s_r = tl.dot(qpe, tl.trans(kpe), input_precision=PRECISION)
            if FP8:  # per-token scales: the latent's, the rope part's
                srow = sc_ptr + page * stride_sc_page + tok * stride_sc_tok
                s_lat = tl.load(srow, mask=pmask, other=0.0)
                s_pe = tl.load(srow + 1, mask=pmask, other=0.0)
                s = s_c * (s_lat * qk_scale)[None, :] + s_r * (s_pe * qk_scale)[None, :]
            else:
                s = s_c * qk_scale + s_r * qk_scale
            s = tl.where(pmask[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            p = tl.exp2(s - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            # Both branches compute the same (and seq_len > 0 inside the loop): the branch
            # hides the score product from the layout of this one ("Layouts" above).
            if seq_len > 0:
                pv = p * s_lat[None, :] if FP8 else p  # the latent scale folds into p
                pv = pv.to(k.dtype)
                acc_in = acc * alpha[:, None]
            else:
                pv = p * s_lat[None, :] if FP8 else p
                pv = pv.to(k.dtype)
                acc_in = acc * alpha[:, None]
            acc = tl.dot(pv, k, acc=acc_in, input_precision=PRECISION)
            m_i = m_new

        has = l_i > 0
        res = acc / tl.where(has, l_i, 1.0)[:, None]
        o = o_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + c[None, :]
        if DIRECT:
            tl.store(o, res.to(o_ptr.dtype.element_ty), mask=hmask[:, None])
        else:
            tl.store(o + split * stride_os, res, mask=hmask[:, None])
            lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
            tl.store(lse_ptr + (b * num_heads + heads) * NUM_SPLITS + split, lse, mask=hmask)

    return partial_wide_kernel
