"""MLA decode preparation in one Triton launch: query rope, latent RMSNorm, key rope, cache write.

For the new tokens of one MLA layer (decode rows and prefill alike: the work is per token) it
replaces this torch sequence (the reference in
``dsmesh.engine.model.mla.MLAttention._rope_and_cache``)::

    q_pe = rotary(q[..., nope:], cos, sin)              # written back into q here
    latent, k_pe = kv_a.split([kv_lora_rank, rope_dim], -1)
    latent = kv_a_layernorm(latent)
    k_pe = rotary(k_pe, cos, sin)
    kv_pool.write(layer, slots, cat([latent, k_pe], -1))

Rope is :class:`dsmesh.engine.model.rope.RotaryEmbedding`'s: with ``interleave`` the pairs (x0, x1),
(x2, x3), ... are rotated and written evens first, then odds; otherwise the two halves are rotated.
The reference multiplies and adds in the promoted dtype of (x, cos), each op rounding to it; the
kernel computes each product and sum in float32 and rounds it to that dtype at the same places
(float32 products of bf16/fp16 values are exact, and FMA contraction is switched off), so the
rotated q and k_pe equal the torch result bit for bit, for float32 and bf16 alike. The latent
RMSNorm is :func:`dsmesh.kernels.norm.rms_norm`'s math (float32 ``rsqrt`` and reduction order:
float32 to a few ulp, bf16 equal or one ulp apart).

Grid (T, head blocks + 1): programs ``(t, j < head blocks)`` rotate a block of q heads of row
``t`` in place, program ``(t, last)`` normalises and rotates ``kv_a[t]`` and stores the row at
``kv_cache_flat[slots[t]]``. The launch depends on shapes only: capturable in a CUDA graph.

:func:`mla_decode_prep_fp8` is the same launch for a pool in the FP8 page format
(``--kv-cache-dtype fp8_e4m3``, :mod:`dsmesh.kernels.kv_fp8`): the row's program quantises
the normalised latent and the rotated key per token (the values the torch path would store,
divided by ``max(amax, 1e-8) / 448`` with round-to-nearest divisions, saturated, rounded to
e4m3 by arithmetic: ``dsmesh.kernels._jit_math.round_to_e4m3``) and stores the codes and both
scales in the slot's page. Same bits as :func:`mla_decode_prep_fp8_ref` for the same
normalised latent and rotated key (the latent's norm may be a few ulp apart, above, and so
its scale and a code).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from dsmesh.kernels._triton import can_launch, next_pow2
from dsmesh.kernels.kv_fp8 import KV_FP8_DTYPE, KV_FP8_MAX, KV_FP8_MIN_AMAX, quantize_kv_fp8
from dsmesh.kernels.norm import SUPPORTED_DTYPES, rms_norm_ref

__all__ = [
    "mla_decode_prep",
    "mla_decode_prep_fp8",
    "mla_decode_prep_fp8_ref",
    "mla_decode_prep_ref",
    "rotary_ref",
]

# @triton.jit helpers the kernel calls, bound by ``_kernels()`` (module globals, as Triton's
# interpreter needs; see dsmesh/kernels/norm.py).
_round_to: Any = None
_rotate: Any = None
_fp8_scale: Any = None
_fp8_codes: Any = None

_MAX_BLOCK_H = 16


def rotary_ref(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool
) -> torch.Tensor:
    """:meth:`dsmesh.engine.model.rope.RotaryEmbedding.forward`: x [T, ..., R]; cos/sin [T, R //
    2]."""
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[1],)
    cos, sin = cos.view(shape), sin.view(shape)
    if interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def mla_decode_prep_ref(
    q: torch.Tensor,
    kv_a: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache_flat: torch.Tensor,
    slots: torch.Tensor,
    interleave: bool,
    nope_dim: int,
    rope_dim: int,
    kv_lora_rank: int,
) -> None:
    """Plain torch, same contract as :func:`mla_decode_prep` (``q`` and ``kv_cache_flat``
    are updated in place)."""
    q[..., nope_dim:] = rotary_ref(q[..., nope_dim:], cos, sin, interleave)
    latent, k_pe = kv_a.split([kv_lora_rank, rope_dim], dim=-1)
    latent = rms_norm_ref(latent, norm_weight, eps)
    k_pe = rotary_ref(k_pe, cos, sin, interleave)
    kv = torch.cat([latent, k_pe], dim=-1)
    kv_cache_flat.index_copy_(0, slots, kv.to(kv_cache_flat.dtype))


def mla_decode_prep_fp8_ref(
    q: torch.Tensor,
    kv_a: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_pages: torch.Tensor,
    kv_scales: torch.Tensor,
    slots: torch.Tensor,
    interleave: bool,
    nope_dim: int,
    rope_dim: int,
    kv_lora_rank: int,
) -> None:
    """Plain torch, same contract as :func:`mla_decode_prep_fp8` (``q``, ``kv_pages`` and
    ``kv_scales`` are updated in place): :func:`mla_decode_prep_ref`'s row, quantised by
    :func:`dsmesh.kernels.kv_fp8.quantize_kv_fp8`."""
    q[..., nope_dim:] = rotary_ref(q[..., nope_dim:], cos, sin, interleave)
    latent, k_pe = kv_a.split([kv_lora_rank, rope_dim], dim=-1)
    latent = rms_norm_ref(latent, norm_weight, eps)
    k_pe = rotary_ref(k_pe, cos, sin, interleave)
    values, scales = quantize_kv_fp8(torch.cat([latent, k_pe], dim=-1), kv_lora_rank)
    page_size = kv_pages.shape[1]
    at = (slots.long() // page_size, slots.long() % page_size)
    kv_pages.view(torch.uint8).index_put_(at, values.view(torch.uint8))
    kv_scales.index_put_(at, scales)


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    from dsmesh.kernels import _jit_math

    global _round_to, _rotate, _fp8_scale, _fp8_codes
    _round_to = _jit_math.round_to
    _rotate = _jit_math.rotate
    _fp8_scale = _jit_math.fp8_scale
    _fp8_codes = _jit_math.fp8_codes

    @triton.jit
    def prep_kernel(
        q_ptr,
        kva_ptr,
        w_ptr,
        cos_ptr,
        sin_ptr,
        cache_ptr,
        slots_ptr,
        n_heads,
        n_head_blocks,
        q_stride_t,
        q_stride_h,
        kva_stride,
        cos_stride,
        sin_stride,
        cache_stride,
        eps,
        scales_ptr,
        cache_page_stride,
        scales_page_stride,
        NOPE: tl.constexpr,
        HALF: tl.constexpr,
        BLOCK_HALF: tl.constexpr,
        LORA: tl.constexpr,
        BLOCK_LORA: tl.constexpr,
        BLOCK_H: tl.constexpr,
        INTERLEAVE: tl.constexpr,
        X_KIND: tl.constexpr,
        ROPE_KIND: tl.constexpr,
        NORM_KIND: tl.constexpr,
        CACHE_KIND: tl.constexpr,
        FP8: tl.constexpr,
        PAGE_SIZE: tl.constexpr,
        FP8_MAX: tl.constexpr,
        MIN_AMAX: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64)
        j = tl.program_id(1)
        i = tl.arange(0, BLOCK_HALF)
        i_mask = i < HALF
        cos = tl.load(cos_ptr + t * cos_stride + i, mask=i_mask, other=0.0).to(tl.float32)
        sin = tl.load(sin_ptr + t * sin_stride + i, mask=i_mask, other=0.0).to(tl.float32)
        if INTERLEAVE:
            off1 = 2 * i
            off2 = 2 * i + 1
        else:
            off1 = i
            off2 = i + HALF
        if j < n_head_blocks:
            heads = j * BLOCK_H + tl.arange(0, BLOCK_H)
            mask = (heads < n_heads)[:, None] & i_mask[None, :]
            base = q_ptr + t * q_stride_t + heads.to(tl.int64)[:, None] * q_stride_h + NOPE
            x1 = tl.load(base + off1[None, :], mask=mask, other=0.0).to(tl.float32)
            x2 = tl.load(base + off2[None, :], mask=mask, other=0.0).to(tl.float32)
            o1, o2 = _rotate(x1, x2, cos[None, :], sin[None, :], ROPE_KIND)
            # In place: every thread's loads must land before any thread overwrites a pair.
            tl.debug_barrier()
            tl.store(base + i[None, :], _round_to(o1, X_KIND), mask=mask)
            tl.store(base + HALF + i[None, :], _round_to(o2, X_KIND), mask=mask)
        else:
            row = kva_ptr + t * kva_stride
            c = tl.arange(0, BLOCK_LORA)
            c_mask = c < LORA
            x = tl.load(row + c, mask=c_mask, other=0.0).to(tl.float32)
            mean_sq = tl.sum(x * x, axis=0) / LORA
            y = _round_to(x * tl.math.rsqrt(mean_sq + eps), X_KIND)
            w = tl.load(w_ptr + c, mask=c_mask, other=0.0).to(tl.float32)
            y = _round_to(y * w, NORM_KIND)
            k1 = tl.load(row + LORA + off1, mask=i_mask, other=0.0).to(tl.float32)
            k2 = tl.load(row + LORA + off2, mask=i_mask, other=0.0).to(tl.float32)
            r1, r2 = _rotate(k1, k2, cos, sin, ROPE_KIND)
            slot = tl.load(slots_ptr + t).to(tl.int64)
            if FP8:  # per-token e4m3 codes and float32 scales, in the slot's page
                page, off = slot // PAGE_SIZE, slot % PAGE_SIZE
                dst = cache_ptr + page * cache_page_stride + off * cache_stride
                s_lat = _fp8_scale(tl.max(tl.abs(y), axis=0), FP8_MAX, MIN_AMAX)
                pe_amax = tl.maximum(tl.max(tl.abs(r1), axis=0), tl.max(tl.abs(r2), axis=0))
                s_pe = _fp8_scale(pe_amax, FP8_MAX, MIN_AMAX)
                tl.store(dst + c, _fp8_codes(y, s_lat, FP8_MAX), mask=c_mask)
                tl.store(dst + LORA + i, _fp8_codes(r1, s_pe, FP8_MAX), mask=i_mask)
                tl.store(dst + LORA + HALF + i, _fp8_codes(r2, s_pe, FP8_MAX), mask=i_mask)
                scale_dst = scales_ptr + page * scales_page_stride + off * 2
                tl.store(scale_dst, s_lat)
                tl.store(scale_dst + 1, s_pe)
            else:
                dst = cache_ptr + slot * cache_stride
                tl.store(dst + c, _round_to(y, CACHE_KIND), mask=c_mask)
                tl.store(dst + LORA + i, _round_to(r1, CACHE_KIND), mask=i_mask)
                tl.store(dst + LORA + HALF + i, _round_to(r2, CACHE_KIND), mask=i_mask)

    return prep_kernel


def _kind(name: str, dtype: torch.dtype) -> int:
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"{name} dtype must be one of {list(SUPPORTED_DTYPES)}, got {dtype}")
    return SUPPORTED_DTYPES[dtype]


def _dense_last(name: str, x: torch.Tensor) -> None:
    if x.stride(-1) != 1:
        raise ValueError(
            f"{name} must be dense in its last dim (written in place), got strides {x.stride()}"
        )


def mla_decode_prep(
    q: torch.Tensor,
    kv_a: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache_flat: torch.Tensor,
    slots: torch.Tensor,
    interleave: bool,
    nope_dim: int,
    rope_dim: int,
    kv_lora_rank: int,
) -> None:
    """One launch for the decode rows of one MLA layer, in place:

    - ``q`` [T, H, nope_dim + rope_dim]: rope on each head's last ``rope_dim`` channels;
    - ``kv_a`` [T, kv_lora_rank + rope_dim] (read only): RMSNorm (``norm_weight``, ``eps``) of
      the first ``kv_lora_rank`` channels and rope of the rest, stored at
      ``kv_cache_flat[slots[t]]`` (``kv_cache_flat`` [num_slots, kv_lora_rank + rope_dim]);
    - ``cos``/``sin`` [T, rope_dim // 2] (:meth:`dsmesh.engine.model.rope.RotaryEmbedding.cos_sin`),
      ``slots`` [T] int64 (or int32).

    Rows may have any stride; last dims must be dense. No host syncs (CUDA-graph capturable).
    Same result as :func:`mla_decode_prep_ref`; see the module docstring for the rounding.
    """
    kinds = _check(q, kv_a, norm_weight, cos, sin, slots, nope_dim, rope_dim, kv_lora_rank)
    if kv_cache_flat.dim() != 2 or kv_cache_flat.shape[1] != kv_lora_rank + rope_dim:
        raise ValueError(
            f"kv_cache_flat must be [num_slots, {kv_lora_rank + rope_dim}], "
            f"got {list(kv_cache_flat.shape)}"
        )
    if kv_cache_flat.device != q.device:
        raise ValueError(f"kv_cache_flat is on {kv_cache_flat.device}, q on {q.device}")
    cache_kind = _kind("kv_cache_flat", kv_cache_flat.dtype)
    _dense_last("kv_cache_flat", kv_cache_flat)
    dest = _Dest(kv_cache_flat, kv_cache_flat.stride(0), cache_kind)
    _launch(q, kv_a, norm_weight, eps, cos, sin, slots, interleave, nope_dim, kinds, dest)


def mla_decode_prep_fp8(
    q: torch.Tensor,
    kv_a: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_pages: torch.Tensor,
    kv_scales: torch.Tensor,
    slots: torch.Tensor,
    interleave: bool,
    nope_dim: int,
    rope_dim: int,
    kv_lora_rank: int,
) -> None:
    """:func:`mla_decode_prep` for one layer of a pool in the FP8 page format: the row of
    token ``t`` (the values :func:`mla_decode_prep` would store) is quantised per token and
    its e4m3 codes go to ``kv_pages[p, o]``, its scales (latent's, rope key's) to
    ``kv_scales[p, o]``, where ``p, o = divmod(slots[t], page_size)``.

    ``kv_pages`` [num_pages, page_size, kv_lora_rank + rope_dim] float8_e4m3fn and
    ``kv_scales`` [num_pages, page_size, 2] float32: the pool's strided views
    (:meth:`dsmesh.engine.kv.pool.MLAKVPool.layer_pages`), dense within a page. Same bits
    as :func:`mla_decode_prep_fp8_ref` (see the module docstring)."""
    kinds = _check(q, kv_a, norm_weight, cos, sin, slots, nope_dim, rope_dim, kv_lora_rank)
    width = kv_lora_rank + rope_dim
    if kv_pages.dim() != 3 or kv_pages.shape[2] != width or kv_pages.dtype != KV_FP8_DTYPE:
        raise ValueError(
            f"kv_pages must be [num_pages, page_size, {width}] {KV_FP8_DTYPE}, got "
            f"{list(kv_pages.shape)} {kv_pages.dtype}"
        )
    if kv_scales.shape != (*kv_pages.shape[:2], 2) or kv_scales.dtype != torch.float32:
        raise ValueError(
            f"kv_scales must be [{kv_pages.shape[0]}, {kv_pages.shape[1]}, 2] float32, got "
            f"{list(kv_scales.shape)} {kv_scales.dtype}"
        )
    for name, x in (("kv_pages", kv_pages), ("kv_scales", kv_scales)):
        if x.device != q.device:
            raise ValueError(f"{name} is on {x.device}, q on {q.device}")
        if x.stride(2) != 1 or x.stride(1) != x.shape[2]:
            raise ValueError(f"{name} must be dense within a page, got strides {x.stride()}")
    dest = _Dest(
        kv_pages, kv_pages.stride(1), 0, kv_scales, kv_pages.stride(0), kv_scales.stride(0)
    )
    _launch(q, kv_a, norm_weight, eps, cos, sin, slots, interleave, nope_dim, kinds, dest)


@dataclass(frozen=True)
class _Dest:
    """Where the row of a token goes: ``values`` with ``slot_stride`` elements between slots
    (a flat cache: ``values[slot]``), in dtype ``cache_kind``; for FP8 also ``scales`` and
    both page strides (``values[slot // page_size, slot % page_size]``)."""

    values: torch.Tensor
    slot_stride: int
    cache_kind: int
    scales: torch.Tensor | None = None
    page_stride: int = 0
    scales_page_stride: int = 0

    @property
    def page_size(self) -> int:
        return self.values.shape[1] if self.scales is not None else 1


def _check(
    q: torch.Tensor,
    kv_a: torch.Tensor,
    norm_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    slots: torch.Tensor,
    nope_dim: int,
    rope_dim: int,
    kv_lora_rank: int,
) -> tuple[int, int, int, int]:
    """Validates the inputs both launches share; returns (x, rope, norm kinds, lora)."""
    if rope_dim <= 0 or rope_dim % 2:
        raise ValueError(f"rope_dim must be even and > 0, got {rope_dim}")
    if q.dim() != 3 or q.shape[2] != nope_dim + rope_dim:
        raise ValueError(f"q must be [T, H, {nope_dim + rope_dim}], got {tuple(q.shape)}")
    t = q.shape[0]
    half = rope_dim // 2
    expect = {
        "kv_a": (kv_a, (t, kv_lora_rank + rope_dim)),
        "norm_weight": (norm_weight, (kv_lora_rank,)),
        "cos": (cos, (t, half)),
        "sin": (sin, (t, half)),
        "slots": (slots, (t,)),
    }
    for name, (tensor, shape) in expect.items():
        if tuple(tensor.shape) != shape:
            raise ValueError(f"{name} must be {list(shape)}, got {list(tensor.shape)}")
        if tensor.device != q.device:
            raise ValueError(f"{name} is on {tensor.device}, q on {q.device}")
    if slots.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"slots must be int64 (or int32), got {slots.dtype}")
    if cos.dtype != sin.dtype:
        raise ValueError(f"cos dtype {cos.dtype} must equal sin dtype {sin.dtype}")
    if kv_a.dtype != q.dtype:
        raise ValueError(f"kv_a dtype {kv_a.dtype} must equal q dtype {q.dtype}")
    x_kind = _kind("q", q.dtype)
    _kind("cos", cos.dtype)
    _kind("norm_weight", norm_weight.dtype)
    rope_kind = _kind("cos", torch.promote_types(q.dtype, cos.dtype))
    norm_kind = _kind("norm_weight", torch.promote_types(q.dtype, norm_weight.dtype))
    _dense_last("q", q)
    if not can_launch(q):
        raise RuntimeError("Triton MLA decode prep needs a CUDA tensor (or TRITON_INTERPRET=1)")
    return x_kind, rope_kind, norm_kind, kv_lora_rank


def _launch(q, kv_a, norm_weight, eps, cos, sin, slots, interleave, nope_dim, kinds, dest):
    """One launch; ``kinds`` from :func:`_check`, the rows go to ``dest``."""
    t, heads = q.shape[0], q.shape[1]
    if t == 0:
        return
    x_kind, rope_kind, norm_kind, lora = kinds
    fp8 = dest.scales is not None
    half = cos.shape[1]
    kv_a, cos, sin = (x if x.stride(-1) == 1 else x.contiguous() for x in (kv_a, cos, sin))
    block_h = min(next_pow2(heads), _MAX_BLOCK_H)
    head_blocks = -(-heads // block_h)
    _kernels()[(t, head_blocks + 1)](
        q,
        kv_a,
        norm_weight.contiguous(),
        cos,
        sin,
        dest.values,
        slots.contiguous(),
        heads,
        head_blocks,
        q.stride(0),
        q.stride(1),
        kv_a.stride(0),
        cos.stride(0),
        sin.stride(0),
        dest.slot_stride,
        float(eps),
        dest.scales if fp8 else dest.values,  # not read without FP8
        dest.page_stride,
        dest.scales_page_stride,
        NOPE=nope_dim,
        HALF=half,
        BLOCK_HALF=next_pow2(half),
        LORA=lora,
        BLOCK_LORA=next_pow2(lora),
        BLOCK_H=block_h,
        INTERLEAVE=bool(interleave),
        X_KIND=x_kind,
        ROPE_KIND=rope_kind,
        NORM_KIND=norm_kind,
        CACHE_KIND=dest.cache_kind,
        FP8=fp8,
        PAGE_SIZE=dest.page_size,
        FP8_MAX=KV_FP8_MAX,
        MIN_AMAX=KV_FP8_MIN_AMAX,
        num_warps=4,
        enable_fp_fusion=False,
    )
