"""Fused MoE for decode-sized batches: align, gate/up GEMM + SwiGLU, down GEMM + routing
weight, combine; four launches, no host sync, capturable in a CUDA graph.

The grouped-GEMM path (:mod:`dsmesh.kernels.moe_gemm`) first permutes the hidden states into expert
order, runs ``torch._grouped_mm`` twice with a separate SwiGLU between them, then scales and
scatter-adds the rows back: about fifteen launches per layer, most of them tiny. At decode
sizes (a few to a few dozen rows per expert) the GEMMs are bound by reading the expert
weights, and the launches around them cost as much again. This module fuses the chain:

1. :func:`moe_align` - one program per expert scans the flat ``(token, slot)`` expert ids and
   writes the pairs routed to it, in token order, at its offset (the number of pairs routed to
   lower experts): a stable counting sort in one launch.
2. gate/up GEMM - programs over (intermediate tile, row tile, expert) gather their rows
   straight from ``x`` (no permuted copy), multiply by the gate and up rows of ``w13`` in one
   pass over K and store ``silu(gate) * up`` (float32 math, one rounding) in expert order.
3. down GEMM - the same grid over the hidden tiles; each row is scaled by its routing weight
   (float32) and stored at its ``(token, slot)`` position.
4. combine - each token sums its ``k`` rows in float32, adds ``add`` (the shared experts'
   output) when given, and rounds once. Pairs whose expert id is outside ``[0, E)`` (not on
   this rank) contribute nothing.

Rows of an expert beyond the first ``BLOCK_M`` go to further programs of the same expert (the
grid holds ``ceil(T / BLOCK_M)`` row tiles per expert; the empty ones return at once), so a hot
expert does not serialise. Large batches (prefill) keep :mod:`dsmesh.kernels.moe_gemm`, whose
grouped GEMM reuses each weight tile across many rows.

The reference is :func:`fused_moe_ref` (per-pair float32 math).
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
from pathlib import Path

import torch
import torch.nn.functional as F

from dsmesh.kernels._triton import can_launch, next_pow2

log = logging.getLogger(__name__)

__all__ = ["fused_moe", "fused_moe_ref", "moe_align", "moe_align_ref"]

# Defaults chosen on the H200 (docs/BENCHMARKS.md, ``python -m dsmesh.bench.kernels --tune``).
# V2-Lite, 256 tokens: 0.362 ms with 16x64x128 tiles for both, 0.285 ms with these (3.9 TB/s).
_GEMM1 = {"block_m": 32, "block_n": 64, "block_k": 128, "num_warps": 4, "num_stages": 3}
_GEMM2 = {"block_m": 32, "block_n": 128, "block_k": 64, "num_warps": 4, "num_stages": 3}
CONFIG_ENV = "DSMESH_MOE_FUSED_CONFIG"
_KEYS = set(_GEMM1)


@functools.cache
def _file_configs() -> tuple[dict, dict]:
    """Block sizes from the JSON file named by ``$DSMESH_MOE_FUSED_CONFIG`` (as
    ``dsmesh.bench.kernels --tune`` writes it: ``{"gate_up": {...}, "down": {...}}``), over the
    defaults; for trying tuned sizes on another GPU without editing code."""
    path = os.environ.get(CONFIG_ENV, "")
    if not path:
        return _GEMM1, _GEMM2
    raw = json.loads(Path(path).read_text())
    out = []
    for name, default in (("gate_up", _GEMM1), ("down", _GEMM2)):
        cfg = raw.get(name, {})
        unknown = set(cfg) - _KEYS
        if unknown:
            raise ValueError(f"{CONFIG_ENV} {path}: {name} has unknown keys {sorted(unknown)}")
        out.append(dict(default, **cfg))
    log.info("fused MoE block sizes from %s: %s", path, out)
    return out[0], out[1]


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def align_kernel(
        ids_ptr, sorted_ptr, starts_ptr, counts_ptr, n_pairs, top_k, stride_it, stride_ik,
        BLOCK: tl.constexpr,
    ):  # fmt: skip
        e = tl.program_id(0)
        start = tl.sum(tl.zeros([BLOCK], tl.int32), axis=0)
        for c in range(0, n_pairs, BLOCK):
            offs = c + tl.arange(0, BLOCK)
            at = (offs // top_k).to(tl.int64) * stride_it + (offs % top_k) * stride_ik
            ids = tl.load(ids_ptr + at, mask=offs < n_pairs, other=-1)
            start += tl.sum(((ids >= 0) & (ids < e)).to(tl.int32), axis=0)
        pos = start
        for c in range(0, n_pairs, BLOCK):
            offs = c + tl.arange(0, BLOCK)
            at = (offs // top_k).to(tl.int64) * stride_it + (offs % top_k) * stride_ik
            ids = tl.load(ids_ptr + at, mask=offs < n_pairs, other=-1)
            hit = (ids == e).to(tl.int32)
            rank = tl.cumsum(hit, axis=0) - 1
            tl.store(sorted_ptr + pos + rank, offs, mask=hit > 0)
            pos += tl.sum(hit, axis=0)
        tl.store(starts_ptr + e, start)
        tl.store(counts_ptr + e, pos - start)

    @triton.jit
    def gate_up_kernel(
        x_ptr,
        w_ptr,
        sg_ptr,
        su_ptr,
        h_ptr,
        sorted_ptr,
        starts_ptr,
        counts_ptr,
        num_experts,
        num_tokens,
        inter,
        hidden,
        top_k,
        stride_xm,
        stride_we,
        stride_wn,
        stride_se,
        stride_sn,
        stride_hm,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        EVEN_K: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        e = tl.program_id(2)
        r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        if e < num_experts:  # routed: rows gathered through the align
            count = tl.load(counts_ptr + e)
            start = tl.load(starts_ptr + e)
            rmask = r < count
            pair = tl.load(sorted_ptr + start + r, mask=rmask, other=0)
            token = (pair // top_k).to(tl.int64)
            g_base = w_ptr + e.to(tl.int64) * stride_we
            u_base = g_base + inter * stride_wn
            wn = stride_wn
        else:  # shared expert: every token, in order, after the routed rows
            count = num_tokens
            start = num_tokens * top_k + (e - num_experts) * num_tokens
            rmask = r < count
            token = r.to(tl.int64)
            g_base = sg_ptr + (e - num_experts).to(tl.int64) * stride_se
            u_base = su_ptr + (e - num_experts).to(tl.int64) * stride_se
            wn = stride_sn
        if pid_m * BLOCK_M < count:
            cmask = cols < inter
            kk = tl.arange(0, BLOCK_K)
            a_ptrs = x_ptr + token[:, None] * stride_xm + kk[None, :]
            g_ptrs = g_base + cols.to(tl.int64)[None, :] * wn + kk[:, None]
            u_ptrs = u_base + cols.to(tl.int64)[None, :] * wn + kk[:, None]
            acc_g = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
            acc_u = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
            for kb in range(0, tl.cdiv(hidden, BLOCK_K)):
                if EVEN_K:
                    a = tl.load(a_ptrs, mask=rmask[:, None], other=0.0)
                    g = tl.load(g_ptrs, mask=cmask[None, :], other=0.0)
                    u = tl.load(u_ptrs, mask=cmask[None, :], other=0.0)
                else:
                    kmask = kk < hidden - kb * BLOCK_K
                    a = tl.load(a_ptrs, mask=rmask[:, None] & kmask[None, :], other=0.0)
                    g = tl.load(g_ptrs, mask=kmask[:, None] & cmask[None, :], other=0.0)
                    u = tl.load(u_ptrs, mask=kmask[:, None] & cmask[None, :], other=0.0)
                acc_g = tl.dot(a, g, acc_g, input_precision=PRECISION)
                acc_u = tl.dot(a, u, acc_u, input_precision=PRECISION)
                a_ptrs += BLOCK_K
                g_ptrs += BLOCK_K
                u_ptrs += BLOCK_K
            h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
            rows = (start + r).to(tl.int64)
            dst = h_ptr + rows[:, None] * stride_hm + cols[None, :]
            tl.store(dst, h.to(h_ptr.dtype.element_ty), mask=rmask[:, None] & cmask[None, :])

    @triton.jit
    def down_kernel(
        h_ptr,
        w_ptr,
        sd_ptr,
        out_ptr,
        sorted_ptr,
        starts_ptr,
        counts_ptr,
        weights_ptr,
        num_experts,
        num_tokens,
        top_k,
        hidden,
        inter,
        stride_hm,
        stride_we,
        stride_wn,
        stride_se,
        stride_sn,
        stride_om,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        EVEN_K: tl.constexpr,
        PRECISION: tl.constexpr,
        HAS_WEIGHTS: tl.constexpr,
    ):
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        e = tl.program_id(2)
        r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        if e < num_experts:
            count = tl.load(counts_ptr + e)
            start = tl.load(starts_ptr + e)
            rmask = r < count
            pair = tl.load(sorted_ptr + start + r, mask=rmask, other=0)
            if HAS_WEIGHTS:
                w = tl.load(weights_ptr + pair, mask=rmask, other=0.0).to(tl.float32)
            else:
                w = tl.full((BLOCK_M,), 1.0, tl.float32)
            b_base = w_ptr + e.to(tl.int64) * stride_we
            wn = stride_wn
        else:
            count = num_tokens
            start = num_tokens * top_k + (e - num_experts) * num_tokens
            rmask = r < count
            pair = start + r
            w = tl.full((BLOCK_M,), 1.0, tl.float32)
            b_base = sd_ptr + (e - num_experts).to(tl.int64) * stride_se
            wn = stride_sn
        if pid_m * BLOCK_M < count:
            rows = (start + r).to(tl.int64)
            cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            cmask = cols < hidden
            kk = tl.arange(0, BLOCK_K)
            a_ptrs = h_ptr + rows[:, None] * stride_hm + kk[None, :]
            b_ptrs = b_base + cols.to(tl.int64)[None, :] * wn + kk[:, None]
            acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
            for kb in range(0, tl.cdiv(inter, BLOCK_K)):
                if EVEN_K:
                    a = tl.load(a_ptrs, mask=rmask[:, None], other=0.0)
                    b = tl.load(b_ptrs, mask=cmask[None, :], other=0.0)
                else:
                    kmask = kk < inter - kb * BLOCK_K
                    a = tl.load(a_ptrs, mask=rmask[:, None] & kmask[None, :], other=0.0)
                    b = tl.load(b_ptrs, mask=kmask[:, None] & cmask[None, :], other=0.0)
                acc = tl.dot(a, b, acc, input_precision=PRECISION)
                a_ptrs += BLOCK_K
                b_ptrs += BLOCK_K
            acc = acc * w[:, None]
            dst = out_ptr + pair.to(tl.int64)[:, None] * stride_om + cols[None, :]
            tl.store(dst, acc, mask=rmask[:, None] & cmask[None, :])

    @triton.jit
    def combine_kernel(
        part_ptr,
        ids_ptr,
        add_ptr,
        out_ptr,
        num_tokens,
        hidden,
        num_experts,
        stride_it,
        stride_ik,
        stride_add,
        stride_out,
        TOP_K: tl.constexpr,
        NUM_SHARED: tl.constexpr,
        HAS_ADD: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        cmask = cols < hidden
        acc = tl.zeros((BLOCK_N,), tl.float32)
        for j in tl.static_range(TOP_K):
            eid = tl.load(ids_ptr + t * stride_it + j * stride_ik)
            ok = (eid >= 0) & (eid < num_experts)
            acc += tl.load(part_ptr + (t * TOP_K + j) * hidden + cols, mask=cmask & ok, other=0.0)
        for s in tl.static_range(NUM_SHARED):
            row = num_tokens * TOP_K + s * num_tokens + t
            acc += tl.load(part_ptr + row * hidden + cols, mask=cmask, other=0.0)
        if HAS_ADD:
            acc += tl.load(add_ptr + t * stride_add + cols, mask=cmask, other=0.0).to(tl.float32)
        tl.store(out_ptr + t * stride_out + cols, acc.to(out_ptr.dtype.element_ty), mask=cmask)

    return align_kernel, gate_up_kernel, down_kernel, combine_kernel


def _check_ids(topk_ids: torch.Tensor) -> torch.Tensor:
    """topk_ids [T, k] int32/int64 with any strides (e.g. ids read from a column of a row
    buffer): the kernels index them through their strides, so no copy."""
    if topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be [tokens, k], got shape {tuple(topk_ids.shape)}")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    return topk_ids


def moe_align(
    topk_ids: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """topk_ids [T, k] -> (sorted_pairs [T*k] int32, starts [E] int32, counts [E] int32).

    ``sorted_pairs[starts[e] : starts[e] + counts[e]]`` are the flat ``t * k + j`` indices
    routed to expert ``e``, ascending. Ids outside ``[0, num_experts)`` are skipped; the tail
    of ``sorted_pairs`` past the routed pairs is unspecified."""
    ids = _check_ids(topk_ids)
    if not can_launch(ids):
        raise RuntimeError("moe_align needs a CUDA tensor (or TRITON_INTERPRET=1)")
    n_pairs = ids.numel()
    sorted_pairs = torch.empty(max(n_pairs, 1), dtype=torch.int32, device=ids.device)
    starts = torch.empty(num_experts, dtype=torch.int32, device=ids.device)
    counts = torch.empty(num_experts, dtype=torch.int32, device=ids.device)
    block = min(max(next_pow2(n_pairs), 16), 1024)
    # Contiguous ids (the router's) read as one flat run: pair i at i, with no per-pair
    # division (Triton specialises the 1s); strided ids through their strides.
    k, stride_t, stride_k = (1, 1, 0) if ids.is_contiguous() else (ids.shape[1], *ids.stride())
    _kernels()[0][(num_experts,)](
        ids, sorted_pairs, starts, counts, n_pairs, k, stride_t, stride_k, BLOCK=block,
    )  # fmt: skip
    return sorted_pairs, starts, counts


def moe_align_ref(
    topk_ids: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    flat = topk_ids.reshape(-1).to(torch.int64)
    valid = (flat >= 0) & (flat < num_experts)
    counts = torch.bincount(flat[valid], minlength=num_experts)
    starts = counts.cumsum(0) - counts
    key = torch.where(valid, flat, num_experts)
    order = torch.argsort(key, stable=True)[: int(valid.sum())]
    return order.to(torch.int32), starts.to(torch.int32), counts.to(torch.int32)


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor | None,
    add: torch.Tensor | None = None,
    shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    gate_up_config: dict | None = None,
    down_config: dict | None = None,
) -> torch.Tensor:
    """Routed SwiGLU experts plus shared experts plus ``add``:
    ``sum_j w[t,j] * E_{ids[t,j]}(x[t]) + S(x[t]) + add[t]``.

    x [T, H] (rows may be strided); w13 [E, 2I, H] (gate rows, then up rows); w2 [E, H, I];
    topk_ids [T, k] (local expert ids, any strides; others are skipped); topk_weights [T, k],
    or None for weight 1 on every pair; ``shared`` the shared experts'
    (gate [S*I, H], up [S*I, H], down [H, S*I]) weights as a DenseMLP holds them, run as S
    more experts of width I on every token with weight 1 (no copy); add [T, H] or None
    -> [T, H] in x's dtype."""
    ids = _check_ids(topk_ids)
    t, hidden = x.shape if x.dim() == 2 else (None, None)
    if t is None:
        raise ValueError(f"x must be [tokens, hidden], got shape {tuple(x.shape)}")
    num_experts, two_inter, h_w = w13.shape
    inter = two_inter // 2
    if h_w != hidden or two_inter % 2:
        raise ValueError(f"w13 {tuple(w13.shape)} does not fit x {tuple(x.shape)}")
    if w2.shape != (num_experts, hidden, inter):
        raise ValueError(f"w2 {tuple(w2.shape)} must be ({num_experts}, {hidden}, {inter})")
    if ids.shape[0] != t or (topk_weights is not None and topk_weights.shape != ids.shape):
        shape = None if topk_weights is None else tuple(topk_weights.shape)
        raise ValueError(
            f"topk_ids {tuple(ids.shape)} and topk_weights {shape} must both be [{t}, k]"
        )
    if add is not None and add.shape != x.shape:
        raise ValueError(f"add {tuple(add.shape)} must match x {tuple(x.shape)}")
    num_shared, sg, su, sd = _check_shared(shared, w13, hidden, inter)
    if not can_launch(x):
        raise RuntimeError("fused_moe needs a CUDA tensor (or TRITON_INTERPRET=1)")
    top_k = ids.shape[1]
    out = torch.empty_like(x)
    if t == 0:
        return out
    x = x if x.stride(1) == 1 else x.contiguous()
    w13 = w13 if w13.stride(2) == 1 else w13.contiguous()
    w2 = w2 if w2.stride(2) == 1 else w2.contiguous()
    has_weights = topk_weights is not None
    weights = topk_weights.reshape(-1).contiguous() if has_weights else x
    sorted_pairs, starts, counts = moe_align(ids, num_experts)
    _, gate_up, down, combine = _kernels()
    precision = _precision(x.dtype)
    rows = t * (top_k + num_shared)
    groups = num_experts + num_shared

    default1, default2 = _file_configs()
    c1 = dict(default1, **(gate_up_config or {}))
    h = torch.empty((rows, inter), dtype=x.dtype, device=x.device)
    grid1 = (math.ceil(inter / c1["block_n"]), math.ceil(t / c1["block_m"]), groups)
    gate_up[grid1](
        x, w13, sg, su, h, sorted_pairs, starts, counts, num_experts, t, inter, hidden, top_k,
        x.stride(0), w13.stride(0), w13.stride(1), inter * sg.stride(0), sg.stride(0),
        h.stride(0),
        BLOCK_M=c1["block_m"], BLOCK_N=c1["block_n"], BLOCK_K=c1["block_k"],
        EVEN_K=hidden % c1["block_k"] == 0, PRECISION=precision,
        num_warps=c1["num_warps"], num_stages=c1["num_stages"],
    )  # fmt: skip

    c2 = dict(default2, **(down_config or {}))
    part = torch.empty((rows, hidden), dtype=torch.float32, device=x.device)
    grid2 = (math.ceil(hidden / c2["block_n"]), math.ceil(t / c2["block_m"]), groups)
    down[grid2](
        h, w2, sd, part, sorted_pairs, starts, counts, weights, num_experts, t, top_k,
        hidden, inter, h.stride(0), w2.stride(0), w2.stride(1), inter, sd.stride(0),
        part.stride(0),
        BLOCK_M=c2["block_m"], BLOCK_N=c2["block_n"], BLOCK_K=c2["block_k"],
        EVEN_K=inter % c2["block_k"] == 0, PRECISION=precision, HAS_WEIGHTS=has_weights,
        num_warps=c2["num_warps"], num_stages=c2["num_stages"],
    )  # fmt: skip

    block_n = min(next_pow2(hidden), 1024)
    add_t = add if add is not None else out
    combine[(t, math.ceil(hidden / block_n))](
        part, ids, add_t, out, t, hidden, num_experts, ids.stride(0), ids.stride(1),
        add_t.stride(0), out.stride(0),
        TOP_K=top_k, NUM_SHARED=num_shared, HAS_ADD=add is not None, BLOCK_N=block_n,
    )  # fmt: skip
    return out


def _check_shared(
    shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    w13: torch.Tensor,
    hidden: int,
    inter: int,
) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(number of width-``inter`` shared experts, gate, up, down); dummies when None."""
    if shared is None:
        return 0, w13, w13, w13
    gate, up, down = shared
    width = gate.shape[0]
    if gate.shape != (width, hidden) or up.shape != gate.shape or width % inter:
        raise ValueError(
            f"shared gate {tuple(gate.shape)} and up {tuple(up.shape)} must both be "
            f"[S * {inter}, {hidden}]"
        )
    if down.shape != (hidden, width):
        raise ValueError(f"shared down {tuple(down.shape)} must be [{hidden}, {width}]")
    if any(w.dtype != w13.dtype for w in shared):
        raise ValueError(f"shared weights must be {w13.dtype} like the routed experts")
    gate, up, down = (w if w.stride(1) == 1 else w.contiguous() for w in shared)
    if up.stride(0) != gate.stride(0):
        up = up.contiguous()
        gate = gate.contiguous()
    return width // inter, gate, up, down


def fused_moe_ref(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor | None,
    add: torch.Tensor | None = None,
    shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Per (token, slot) pair in float32; ids outside [0, E) contribute nothing; no
    ``topk_weights``: weight 1."""
    num_experts = w13.shape[0]
    if shared is not None:
        gate, up, down = (w.float() for w in shared)
        shared_out = F.linear(F.silu(F.linear(x.float(), gate)) * F.linear(x.float(), up), down)
        add = shared_out if add is None else add.float() + shared_out
    acc = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    xf = x.float()
    for t in range(x.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            if not 0 <= e < num_experts:
                continue
            gate, up = F.linear(xf[t], w13[e].float()).chunk(2)
            w = 1.0 if topk_weights is None else float(topk_weights[t, j])
            acc[t] += w * F.linear(F.silu(gate) * up, w2[e].float())
    if add is not None:
        acc += add.float()
    return acc.to(x.dtype)
