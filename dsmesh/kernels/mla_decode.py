"""Weight-absorbed MLA decode attention over the paged latent cache (Triton, split-K).

Per request ``b`` and head ``h`` with the query already absorbed (``q_latent = q_nope @ W_UK``):

    score[s] = (q_latent[b, h] . kv[s, :C] + q_pe[b, h] . kv[s, C:]) * scale
    out[b, h] = softmax(score[:seq_lens[b]]) @ kv[:seq_lens[b], :C]

where token ``s`` of request ``b`` lives at ``kv[page_table[b, s // page_size], s % page_size]``.
The latent is both key (with the rope part) and value, so each cached token is read once for
all of a program's heads.

Flash-decoding: the context is cut into ``num_splits`` pieces, each program attends over one
piece for a block of heads with an online softmax and writes a normalised partial result and
its log-sum-exp; a second kernel merges the pieces. The split count depends only on shapes, and
nothing reads device values on the host, so the call can be captured in a CUDA graph.

Two partial kernels, chosen from the shapes: 16 heads per program here (few heads, V2-Lite's
16: memory-bound), and 64 per program in :mod:`dsmesh.kernels.mla_decode_wide` (64 heads or
more in 16-bit, V3's 128: compute-bound, warpgroup MMAs on Hopper).

FP8 cache (``kv_scales``; docs/KERNELS.md, "Contracts"): ``kv`` is float8_e4m3fn with two
float32 scales per token, and

    score[s] = ((q_latent . lat8[s]) * s_lat[s] + (q_pe . pe8[s]) * s_pe[s]) * scale
    out      = sum_s p[s] * s_lat[s] * lat8[s]
"""

from __future__ import annotations

import functools
import math

import torch

from dsmesh.kernels._triton import can_launch, next_pow2
from dsmesh.kernels.mla_decode_wide import (
    WIDE_BLOCK_H,
    wide_config,
    wide_kernel,
    wide_num_splits,
)

__all__ = [
    "fp8_kv_pages",
    "mla_decode",
    "mla_decode_ref",
    "num_splits_for",
    "uses_wide_kernel",
]

_LOG2E = 1.4426950408889634
_NUM_SMS_DEFAULT = 132


def mla_decode_ref(
    q_latent: torch.Tensor,
    q_pe: torch.Tensor,
    kv: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    kv_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain torch, float32 softmax; same contract as :func:`mla_decode`. A 16-bit cache is
    rounded to q's dtype first; an FP8 one (``kv_scales``) is dequantised in float32."""
    b, h, c = q_latent.shape
    page_size = kv.shape[1]
    width = page_table.shape[1] * page_size
    pos = torch.arange(width, device=kv.device)
    pages = page_table.long()[:, pos // page_size]  # [B, W]
    tok = (pos % page_size).expand_as(pages)
    if kv_scales is None:
        ctx = kv[pages, tok].to(q_latent.dtype)  # [B, W, C + R]
        latent, k_pe = ctx[..., :c], ctx[..., c:]
    else:
        ctx = kv[pages, tok].float()
        sc = kv_scales[pages, tok].float()  # [B, W, 2]
        latent, k_pe = ctx[..., :c] * sc[..., :1], ctx[..., c:] * sc[..., 1:]
    scores = torch.einsum("bhc,bsc->bhs", q_latent.float(), latent.float())
    scores = (scores + torch.einsum("bhr,bsr->bhs", q_pe.float(), k_pe.float())) * scale
    valid = pos[None, :] < seq_lens.long()[:, None]
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    probs = scores.softmax(dim=-1).nan_to_num(0.0)  # an empty context gives zeros
    result = torch.einsum("bhs,bsc->bhc", probs, latent.float()).to(q_latent.dtype)
    if out is not None:
        out.copy_(result)
        return out
    return result


def fp8_kv_pages(kv: torch.Tensor, kv_lora_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's cache ``kv`` [pages, page_size, C + R] quantised to the FP8 page layout
    (docs/KERNELS.md, "Contracts"): returns the ``kv`` view (float8_e4m3fn) and the
    ``kv_scales`` view ([pages, page_size, 2] float32) of one uint8 buffer
    [pages, page_size * (C + R) + page_size * 8], as the pool lays a page out. Per token:
    ``s = max(amax(|part|), 1e-8) / 448`` for the latent and the rope part, ``fp8(part / s)``.
    For tests and benchmarks (the engine quantises when it writes the cache)."""
    pages, page_size, dim = kv.shape
    c = kv_lora_rank
    x = kv.float()
    s_lat = x[..., :c].abs().amax(-1).clamp_min(1e-8) / 448
    s_pe = x[..., c:].abs().amax(-1).clamp_min(1e-8) / 448
    q = torch.cat([x[..., :c] / s_lat[..., None], x[..., c:] / s_pe[..., None]], dim=-1)
    values = page_size * dim
    buffer = torch.empty(pages, values + page_size * 8, dtype=torch.uint8, device=kv.device)
    kv8 = buffer[:, :values].view(torch.float8_e4m3fn).view(pages, page_size, dim)
    scales = buffer[:, values:].view(torch.float32).view(pages, page_size, 2)
    kv8.copy_(q.clamp(-448, 448).to(torch.float8_e4m3fn))
    scales.copy_(torch.stack([s_lat, s_pe], dim=-1))
    return kv8, scales


@functools.cache
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_splits_for(batch: int, heads: int, max_context: int, block_h: int, num_sms: int) -> int:
    """Context pieces per (request, head block): enough programs for one and a half waves on
    the GPU, each piece at least 128 tokens long, at most 64 pieces. Shapes only
    (graph-safe). Tuned on the H200 for 16 heads and 2000 tokens (docs/BENCHMARKS.md): 2
    pieces at batch 128 instead of 3 is 18% faster, 1 at batch 256 equals 2, 7-9 at 32."""
    programs = batch * math.ceil(heads / block_h)
    want = math.ceil(1.5 * num_sms / programs)
    return max(1, min(want, math.ceil(max_context / 128), 64))


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def partial_kernel(
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
        BLOCK_C: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_N: tl.constexpr,
        PAGE_SIZE: tl.constexpr,
        NUM_SPLITS: tl.constexpr,
        DIRECT: tl.constexpr,
        PRECISION: tl.constexpr,
        IN_PAGE: tl.constexpr,
        FULL_WIDTH: tl.constexpr,
        FP8: tl.constexpr,
    ):
        b = tl.program_id(0)
        hb = tl.program_id(1)
        split = tl.program_id(2)
        seq_len = tl.load(lens_ptr + b)
        per_split = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
        start = split * per_split
        end = tl.minimum(start + per_split, seq_len)

        heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
        hmask = heads < num_heads
        c = tl.arange(0, BLOCK_C)
        r = tl.arange(0, BLOCK_R)
        cmask = c < C
        rmask = r < R
        q = tl.load(
            q_ptr + b * stride_qb + heads[:, None] * stride_qh + c[None, :],
            mask=hmask[:, None] & cmask[None, :],
            other=0.0,
        )
        qpe = tl.load(
            qpe_ptr + b * stride_pb + heads[:, None] * stride_ph + r[None, :],
            mask=hmask[:, None] & rmask[None, :],
            other=0.0,
        )
        if not FP8:  # products in the cache's dtype; an FP8 tile is widened to q's instead
            q = q.to(kv_ptr.dtype.element_ty)
            qpe = qpe.to(kv_ptr.dtype.element_ty)

        m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_H,), tl.float32)
        acc = tl.zeros((BLOCK_H, BLOCK_C), tl.float32)
        pt_row = pt_ptr + b.to(tl.int64) * stride_pt
        for n0 in range(start, end, BLOCK_N):
            pos = n0 + tl.arange(0, BLOCK_N)
            pmask = pos < end
            if IN_PAGE:  # the tile lies in one page: one page-id load, contiguous rows
                page = tl.load(pt_row + n0 // PAGE_SIZE).to(tl.int64)
                row = page * stride_kv_page + (pos % PAGE_SIZE) * stride_kv_tok
            else:
                page = tl.load(pt_row + pos // PAGE_SIZE, mask=pmask, other=0).to(tl.int64)
                row = page * stride_kv_page + (pos % PAGE_SIZE) * stride_kv_tok
            if FULL_WIDTH:  # C and R fill their blocks: only the row mask
                k = tl.load(kv_ptr + row[:, None] + c[None, :], mask=pmask[:, None], other=0.0)
                kpe = tl.load(
                    kv_ptr + row[:, None] + C + r[None, :], mask=pmask[:, None], other=0.0
                )
            else:
                k = tl.load(
                    kv_ptr + row[:, None] + c[None, :],
                    mask=pmask[:, None] & cmask[None, :],
                    other=0.0,
                )
                kpe = tl.load(
                    kv_ptr + row[:, None] + C + r[None, :],
                    mask=pmask[:, None] & rmask[None, :],
                    other=0.0,
                )
            if FP8:  # widen the tile; per-token scales on the two scores and on p
                k = k.to(q.dtype)
                kpe = kpe.to(q.dtype)
                srow = sc_ptr + page * stride_sc_page + (pos % PAGE_SIZE) * stride_sc_tok
                s_lat = tl.load(srow, mask=pmask, other=0.0)
                s_pe = tl.load(srow + 1, mask=pmask, other=0.0)
                s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * s_lat[None, :]
                s_r = tl.dot(qpe, tl.trans(kpe), input_precision=PRECISION)
                s += s_r * s_pe[None, :]
            else:
                s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
                s = tl.dot(qpe, tl.trans(kpe), acc=s, input_precision=PRECISION)
            s = tl.where(pmask[None, :], s * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            p = tl.exp2(s - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            if FP8:
                p = p * s_lat[None, :]  # the latent scale folds into the probabilities
                # The values read again (from L2): Triton pipelines an FP8 tile that feeds one
                # product, but not one widened for two (a synchronous load each tile: half
                # the bf16 kernel's speed at 16 heads).
                v = tl.load(
                    kv_ptr + row[:, None] + c[None, :],
                    mask=pmask[:, None] & cmask[None, :],
                    other=0.0,
                    eviction_policy="evict_first",
                ).to(q.dtype)
            else:
                v = k
            acc = tl.dot(p.to(v.dtype), v, acc=acc * alpha[:, None], input_precision=PRECISION)
            m_i = m_new

        has = l_i > 0
        res = acc / tl.where(has, l_i, 1.0)[:, None]
        o = o_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + c[None, :]
        if DIRECT:
            tl.store(o, res.to(o_ptr.dtype.element_ty), mask=hmask[:, None] & cmask[None, :])
        else:
            tl.store(o + split * stride_os, res, mask=hmask[:, None] & cmask[None, :])
            lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
            tl.store(lse_ptr + (b * num_heads + heads) * NUM_SPLITS + split, lse, mask=hmask)

    @triton.jit
    def combine_kernel(
        part_ptr,
        lse_ptr,
        out_ptr,
        num_heads,
        stride_pb,
        stride_ph,
        stride_ps,
        stride_ob,
        stride_oh,
        C: tl.constexpr,
        BLOCK_C: tl.constexpr,
        NUM_SPLITS: tl.constexpr,
        BLOCK_S: tl.constexpr,
    ):
        b = tl.program_id(0)
        h = tl.program_id(1)
        s = tl.arange(0, BLOCK_S)
        c = tl.arange(0, BLOCK_C)
        smask = s < NUM_SPLITS
        lse = tl.load(lse_ptr + (b * num_heads + h) * NUM_SPLITS + s, mask=smask, other=-1e30)
        lse = tl.where(lse == float("-inf"), -1e30, lse)
        w = tl.exp2(lse - tl.max(lse, axis=0))
        w = tl.where(lse > -1e29, w, 0.0)
        part = tl.load(
            part_ptr
            + b.to(tl.int64) * stride_pb
            + h * stride_ph
            + s[:, None] * stride_ps
            + c[None, :],
            mask=smask[:, None] & (c < C)[None, :],
            other=0.0,
        )
        total = tl.sum(w, axis=0)
        res = tl.sum(part * w[:, None], axis=0) / tl.where(total > 0, total, 1.0)
        tl.store(
            out_ptr + b.to(tl.int64) * stride_ob + h * stride_oh + c,
            res.to(out_ptr.dtype.element_ty),
            mask=c < C,
        )

    return partial_kernel, combine_kernel


_DEFAULT_CONFIG = {"block_h": 16, "block_n": 32, "num_warps": 4, "num_stages": 2}
# Few heads (V2-Lite's 16): 32-token tiles and a 6-deep pipeline (two tiles of the cache in
# flight). H200, 2000 tokens, page 16 (docs/BENCHMARKS.md): at batch 256, 0.202 ms against
# 0.239 for one-page tiles 5 deep, with one split as with two.
_FEW_HEADS_CONFIG = {"block_h": 16, "block_n": 32, "num_warps": 4, "num_stages": 6}


def uses_wide_kernel(heads: int, c: int, r: int, dtype: torch.dtype) -> bool:
    """Whether :func:`mla_decode` runs the 64-head kernel (:mod:`dsmesh.kernels.mla_decode_wide`):
    at least 64 heads, a 16-bit query and power-of-two latent and rope widths (DeepSeek's 512
    and 64). Shapes and dtype only."""
    pow2 = c == next_pow2(c) and r == next_pow2(r) and min(c, r) >= 16
    return heads >= WIDE_BLOCK_H and pow2 and dtype in (torch.bfloat16, torch.float16)


def mla_decode(
    q_latent: torch.Tensor,
    q_pe: torch.Tensor,
    kv: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    config: dict | None = None,
    kv_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """q_latent [B, H, C], q_pe [B, H, R], kv [num_pages, page_size, C + R] (one layer of the
    pool), page_table [B, max_pages] int32, seq_lens [B] int32 -> [B, H, C] in q's dtype.

    Softmax over the first ``seq_lens[b]`` tokens of request ``b`` (a request with none gets
    zeros). ``kv_scales`` [num_pages, page_size, 2] float32 (latent, rope scale per token) marks
    an FP8 cache: ``kv`` is then float8_e4m3fn, either may be a strided view into the pool's
    pages. ``num_splits`` and ``config`` override the shape-based choices (benchmarks, tests):
    ``config["kernel"]`` is ``"wide"`` (64 heads a program) or ``"narrow"`` (16), other keys
    are block sizes.
    """
    b, h, c = q_latent.shape
    r = q_pe.shape[-1]
    if kv.dim() != 3 or kv.shape[-1] != c + r:
        raise ValueError(f"kv must be [pages, page_size, {c + r}], got {tuple(kv.shape)}")
    if q_pe.shape[:2] != (b, h) or page_table.shape[0] != b or seq_lens.shape != (b,):
        raise ValueError(
            f"q_pe {tuple(q_pe.shape)}, page_table {tuple(page_table.shape)} and seq_lens "
            f"{tuple(seq_lens.shape)} must share the batch size {b} (and heads {h})"
        )
    fp8 = kv_scales is not None
    if fp8 and (kv.dtype != torch.float8_e4m3fn or kv_scales.dtype != torch.float32):
        raise ValueError(
            f"kv_scales needs kv float8_e4m3fn and scales float32, got {kv.dtype} and "
            f"{kv_scales.dtype}"
        )
    if fp8 and (kv_scales.shape != (*kv.shape[:2], 2) or kv_scales.stride(-1) != 1):
        raise ValueError(
            f"kv_scales must be [{kv.shape[0]}, {kv.shape[1]}, 2] with unit last stride, got "
            f"{tuple(kv_scales.shape)} strides {kv_scales.stride()}"
        )
    if not fp8 and kv.dtype == torch.float8_e4m3fn:
        raise ValueError("an FP8 kv needs kv_scales")
    if not can_launch(q_latent):
        raise RuntimeError("mla_decode needs a CUDA tensor (or TRITON_INTERPRET=1)")
    if kv.stride(-1) != 1 or q_latent.stride(-1) != 1 or q_pe.stride(-1) != 1:
        raise ValueError("mla_decode needs unit stride in the last dimension of q and kv")
    if out is None:
        out = torch.empty((b, h, c), dtype=q_latent.dtype, device=q_latent.device)
    if b == 0:
        return out
    cfg = dict(config or {})
    kernel = cfg.pop("kernel", None)
    wide = uses_wide_kernel(h, c, r, q_latent.dtype) if kernel is None else kernel == "wide"
    page_size = kv.shape[1]
    max_context = page_table.shape[1] * page_size
    sms = _num_sms(q_latent.device.index or 0) if q_latent.is_cuda else _NUM_SMS_DEFAULT
    if wide:
        if c != next_pow2(c) or r != next_pow2(r) or min(c, r) < 16:
            raise ValueError(f"the 64-head kernel needs power-of-two C, R >= 16, got {c}, {r}")
        cfg = {**wide_config(b, h, max_context, fp8), **cfg}
        block_h = WIDE_BLOCK_H
        if num_splits is None:
            num_splits = wide_num_splits(b, h, max_context, sms)
    else:
        cfg = {**(_FEW_HEADS_CONFIG if h <= 16 else _DEFAULT_CONFIG), **cfg}
        block_h = max(16, min(cfg["block_h"], next_pow2(h)))
        if num_splits is None:
            num_splits = num_splits_for(b, h, max_context, block_h, sms)
    partial, combine = _kernels()
    fp32 = q_latent.dtype == torch.float32 if fp8 else kv.dtype == torch.float32
    block_c = max(16, next_pow2(c))
    block_r = max(16, next_pow2(r))
    direct = num_splits == 1
    if direct:
        part, lse = out, out  # lse unused
        stride_part = (out.stride(0), out.stride(1), 0)
    else:
        part = torch.empty((b, h, num_splits, c), dtype=torch.float32, device=out.device)
        lse = torch.empty((b, h, num_splits), dtype=torch.float32, device=out.device)
        stride_part = (part.stride(0), part.stride(1), part.stride(2))
    sc = kv_scales if fp8 else kv  # not read without FP8
    sc_strides = (kv_scales.stride(0), kv_scales.stride(1)) if fp8 else (0, 0)
    common = dict(
        NUM_SPLITS=num_splits,
        DIRECT=direct,
        PRECISION="ieee" if fp32 else "tf32",
        # Every tile starts at a multiple of BLOCK_N (so does every split's piece), so when
        # BLOCK_N divides the page size a tile lies inside one page (IN_PAGE).
        IN_PAGE=page_size % cfg["block_n"] == 0,
        FP8=fp8,
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    args = (
        q_latent,
        q_pe,
        kv,
        sc,
        page_table,
        seq_lens,
        part,
        lse,
        h,
        q_latent.stride(0),
        q_latent.stride(1),
        q_pe.stride(0),
        q_pe.stride(1),
        kv.stride(0),
        kv.stride(1),
        *sc_strides,
        page_table.stride(0),
        *stride_part,
        scale * _LOG2E,
    )
    if wide:  # head blocks of one request side by side in the grid (its cache stays in L2)
        grid = (math.ceil(h / block_h), b, num_splits)
        wide_kernel()[grid](
            *args, C=c, R=r, BLOCK_H=block_h, BLOCK_N=cfg["block_n"], PAGE_SIZE=page_size,
            **common,
        )  # fmt: skip
    else:
        grid = (b, math.ceil(h / block_h), num_splits)
        partial[grid](
            *args, C=c, R=r, BLOCK_C=block_c, BLOCK_R=block_r, BLOCK_H=block_h,
            BLOCK_N=cfg["block_n"], PAGE_SIZE=page_size,
            FULL_WIDTH=block_c == c and block_r == r, **common,
        )  # fmt: skip
    if not direct:
        combine[(b, h)](
            part,
            lse,
            out,
            h,
            part.stride(0),
            part.stride(1),
            part.stride(2),
            out.stride(0),
            out.stride(1),
            C=c,
            BLOCK_C=block_c,
            NUM_SPLITS=num_splits,
            BLOCK_S=max(2, next_pow2(num_splits)),
            num_warps=4,
        )
    return out
