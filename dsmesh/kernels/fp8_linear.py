"""Block-scaled FP8 linear layers: ``y = x @ W.T`` with W as DeepSeek-V3 stores it.

W is float8_e4m3fn [N, K] with float32 ``weight_scale_inv`` [ceil(N/128), ceil(K/128)] (the
checkpoint's 128x128 blocks, :mod:`dsmesh.kernels.fp8`). The activation x [M, K] (bf16) is
quantised per token per group of 128 columns (``scale = amax / 448``), then one FP8 GEMM
multiplies the two with both scales applied per 128-deep K block and accumulates in float32,
as SGLang and vLLM run DeepSeek's FP8 attention projections and shared experts.

Three implementations, the same contract:

- :func:`fp8_linear_ref`: the torch reference, ``dequantise(W) @ dequantise(quantise(x))`` in
  float32, then cast;
- ``"triton"``: dsmesh's per-token-group quantisation (:mod:`dsmesh.kernels.fp8_quant`) and
  the Triton GEMM below, whose tile sizes follow M (decode rows or prefill chunks);
- ``"deep_gemm"``: the same quantisation writing its scales in DeepGEMM's MN-major,
  TMA-aligned layout, then DeepGEMM's ``fp8_gemm_nt`` (``sgl-deep-gemm``; the weight scales go
  in as stored: float32 128x128 blocks are the layout it takes on Hopper). It needs K a
  multiple of 128 and N a multiple of 64 (of 128 where a check at N = 576 fails:
  :func:`deep_gemm_fits`, :func:`deep_gemm_n_alignment`); other shapes run Triton.

K need not be a multiple of 128 (toy checkpoints): the activation is zero-padded to whole
groups (zeros change no group's amax), and the GEMM masks the weight's ragged edge. Every path
has static shapes and no host synchronisation, so a CUDA graph captures it.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from dsmesh.kernels._triton import can_launch
from dsmesh.kernels.fp8 import (
    BLOCK,
    FP8_DTYPE,
    block_scale_shape,
    dequantize_fp8_block,
    dequantize_fp8_per_token_group,
    quantize_fp8_per_token_group,
)

__all__ = [
    "FP8_LINEAR_BACKENDS",
    "deep_gemm_fits",
    "fp8_block_gemm",
    "fp8_linear",
    "fp8_linear_ref",
    "quantize_activation_ref",
]

FP8_LINEAR_BACKENDS = ("torch", "triton", "deep_gemm")


def _check(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor) -> None:
    if weight.dim() != 2 or weight.dtype != FP8_DTYPE:
        raise ValueError(f"weight must be [N, K] float8_e4m3fn, got {weight.dtype} {weight.shape}")
    n, k = weight.shape
    if x.shape[-1] != k:
        raise ValueError(f"x's last dim {x.shape[-1]} must be the weight's K = {k}")
    expected = block_scale_shape((n, k), (BLOCK, BLOCK))
    if tuple(scale_inv.shape) != expected or scale_inv.dtype != torch.float32:
        raise ValueError(
            f"weight_scale_inv for a [{n}, {k}] weight must be float32 {expected}, got "
            f"{scale_inv.dtype} {tuple(scale_inv.shape)}"
        )


def _pad_groups(x: torch.Tensor) -> torch.Tensor:
    """``x`` [M, K] zero-padded on the right to whole 128-column groups (a view if whole)."""
    k = x.shape[-1]
    pad = -k % BLOCK
    return F.pad(x, (0, pad)) if pad else x


def quantize_activation_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q [M, K] e4m3, scale [M, ceil(K/128)] float32): per token per group of
    128 columns, the last group ragged when K is not a multiple of 128."""
    k = x.shape[-1]
    q, scale = quantize_fp8_per_token_group(_pad_groups(x), BLOCK)
    return q[..., :k], scale


def fp8_linear_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """x [..., K] -> [..., N] in ``out_dtype`` (default x's): exactly
    ``dequantise(W) @ dequantise(quantise_per_token_group(x))`` computed in float32."""
    _check(x, weight, scale_inv)
    lead, k = x.shape[:-1], x.shape[-1]
    q, scale = quantize_activation_ref(x.reshape(-1, k))
    a = dequantize_fp8_per_token_group(_pad_groups(q.float()), scale, BLOCK)[:, :k]
    w = dequantize_fp8_block(weight, scale_inv, (BLOCK, BLOCK))
    return (a @ w.T).to(out_dtype or x.dtype).view(*lead, weight.shape[0])


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def fp8_gemm_kernel(
        a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, m, n, k,
        stride_am, stride_asm, stride_asg, stride_bn, stride_bsn, stride_cm,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr, EVEN_K: tl.constexpr,
    ):  # fmt: skip
        # Tiles ordered in groups of GROUP_M rows, so consecutive programs share W's columns
        # in L2 (large M); with one row tile this is plain column order.
        pid = tl.program_id(0)
        num_m = tl.cdiv(m, BLOCK_M)
        num_n = tl.cdiv(n, BLOCK_N)
        per_group = GROUP_M * num_n
        first_m = (pid // per_group) * GROUP_M
        group_m = tl.minimum(num_m - first_m, GROUP_M)
        pid_m = first_m + (pid % per_group) % group_m
        pid_n = (pid % per_group) // group_m

        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rmask = rows < m
        cmask = cols < n
        kk = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + rows.to(tl.int64)[:, None] * stride_am + kk[None, :]
        b_ptrs = b_ptr + cols.to(tl.int64)[None, :] * stride_bn + kk[:, None]
        as_ptrs = as_ptr + rows.to(tl.int64) * stride_asm
        bs_ptrs = bs_ptr + ((pid_n * BLOCK_N) // 128) * stride_bsn
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for kb in range(0, tl.cdiv(k, BLOCK_K)):
            a = tl.load(a_ptrs, mask=rmask[:, None], other=0.0)
            if EVEN_K:
                b = tl.load(b_ptrs, mask=cmask[None, :], other=0.0)
            else:
                kmask = kk < k - kb * BLOCK_K
                b = tl.load(b_ptrs, mask=cmask[None, :] & kmask[:, None], other=0.0)
            sa = tl.load(as_ptrs + kb * stride_asg, mask=rmask, other=0.0)
            sb = tl.load(bs_ptrs + kb)
            acc += tl.dot(a, b) * (sa[:, None] * sb)
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K
        c = c_ptr + rows.to(tl.int64)[:, None] * stride_cm + cols[None, :]
        tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=rmask[:, None] & cmask[None, :])

    return fp8_gemm_kernel


def gemm_config(m: int) -> dict[str, int]:
    """Tile sizes for ``m`` rows: thin row tiles for decode batches (so more programs span
    N), 128 x 128 tiles for prefill chunks. A pure function of the static shape, so a CUDA
    graph captures one choice per batch size."""
    if m <= 16:
        return {"block_m": 16, "block_n": 64, "num_warps": 4, "num_stages": 5}
    if m <= 32:
        return {"block_m": 32, "block_n": 64, "num_warps": 4, "num_stages": 5}
    if m <= 64:
        return {"block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 4}
    if m <= 256:
        return {"block_m": 64, "block_n": 128, "num_warps": 4, "num_stages": 4}
    return {"block_m": 128, "block_n": 128, "num_warps": 8, "num_stages": 3}


def fp8_block_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    config: dict[str, int] | None = None,
) -> torch.Tensor:
    """a [M, Kp] e4m3 (Kp = K rounded up to 128, zero beyond K), a_scale [M, Kp/128] float32
    (any strides), weight [N, K] e4m3, scale_inv [ceil(N/128), Kp/128] -> [M, N] in
    ``out_dtype``: ``(a * a_scale) @ (weight * scale_inv).T`` per 128-deep block, in one
    Triton launch."""
    m, kp = a.shape
    n, k = weight.shape
    if kp != math.ceil(k / BLOCK) * BLOCK or a.stride(1) != 1:
        raise ValueError(f"a [{m}, {kp}] must be contiguous rows of K = {k} padded to 128s")
    if tuple(a_scale.shape) != (m, kp // BLOCK):
        raise ValueError(f"a_scale {tuple(a_scale.shape)} must be [{m}, {kp // BLOCK}]")
    if weight.stride(1) != 1 or scale_inv.stride(1) != 1:
        weight, scale_inv = weight.contiguous(), scale_inv.contiguous()
    if not can_launch(a):
        raise RuntimeError("fp8_block_gemm needs a CUDA tensor (or TRITON_INTERPRET=1)")
    cfg = dict(gemm_config(m), **(config or {}))
    out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0:
        return out
    bm, bn = cfg["block_m"], cfg["block_n"]
    grid = (math.ceil(m / bm) * math.ceil(n / bn),)
    _kernel()[grid](
        a, a_scale, weight, scale_inv, out, m, n, k,
        a.stride(0), a_scale.stride(0), a_scale.stride(1), weight.stride(0),
        scale_inv.stride(0), out.stride(0),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=BLOCK, GROUP_M=8, EVEN_K=k % BLOCK == 0,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    return out


def deep_gemm_fits(n: int, k: int, dtype: torch.dtype, n_align: int = 64) -> bool:
    """Whether DeepGEMM's dense FP8 GEMM takes an [N, K] weight with ``dtype`` output: K
    whole 128-blocks, N a multiple of ``n_align`` (:func:`deep_gemm_n_alignment`: 64 where
    its check passed at N = 576, else 128), bfloat16 output."""
    return k % BLOCK == 0 and n % n_align == 0 and dtype == torch.bfloat16


def _check_deep_gemm(n: int, device: str) -> str:
    """Empty when ``fp8_gemm_nt`` computes a 5 x ``n`` x 256 problem right here, else what
    went wrong."""
    try:
        from dsmesh.kernels.fp8 import quantize_fp8_block

        g = torch.Generator(device="cpu").manual_seed(0)
        x = torch.randn(5, 256, generator=g).to(device, torch.bfloat16)
        w, scale_inv = quantize_fp8_block(torch.randn(n, 256, generator=g) * 0.05)
        w, scale_inv = w.to(device), scale_inv.to(device)
        out = _deep_gemm_linear(x, w, scale_inv).float()
        ref = fp8_linear_ref(x.float(), w, scale_inv)
        err = float((out - ref).norm() / ref.norm())
        if not err < 1e-2:
            return f"fp8_gemm_nt is off by {err:.3g} (relative) on a 5 x {n} x 256 problem"
    except Exception as exc:  # a build that cannot run here: say why, keep Triton
        return f"fp8_gemm_nt failed: {type(exc).__name__}: {str(exc)[:200]}"
    return ""


@functools.cache
def deep_gemm_n_alignment(device: str = "cuda") -> int | None:
    """The N multiple DeepGEMM's dense FP8 GEMM is used for: 64 when it computes N = 576
    (V3's kv_a_proj: a ragged last scale block) right, 128 when only N = 512, None when
    neither (then :func:`deep_gemm_linear_problem` says why). Checked once, outside any
    CUDA graph (the engine asks when it chooses its kernels)."""
    if not _check_deep_gemm(512, device):
        return 64 if not _check_deep_gemm(576, device) else 128
    return None


@functools.cache
def deep_gemm_linear_problem(device: str = "cuda") -> str:
    """Empty when DeepGEMM's ``fp8_gemm_nt`` computes a small problem of DeepSeek's kind
    right here (5 x 512 x 256 against the reference), else what went wrong. Checked once,
    before the engine chooses it, so that a build or GPU it does not fit leaves the linears
    on Triton instead of failing in the first forward."""
    if deep_gemm_n_alignment(device) is not None:
        return ""
    return _check_deep_gemm(512, device)


def _deep_gemm_linear(x2d: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor):
    from dsmesh.kernels.fp8_quant import per_token_group_quant_fp8
    from dsmesh.kernels.moe_gemm_deepgemm import load_deep_gemm

    deep_gemm = load_deep_gemm()
    if deep_gemm is None:
        raise RuntimeError("deep_gemm is not importable here")
    a, a_scale = per_token_group_quant_fp8(x2d, BLOCK, mn_major_scales=True)
    out = torch.empty((x2d.shape[0], weight.shape[0]), dtype=x2d.dtype, device=x2d.device)
    if x2d.shape[0]:
        deep_gemm.fp8_gemm_nt((a, a_scale), (weight, scale_inv), out)
    return out


def _n_align() -> int:
    """:func:`deep_gemm_n_alignment` on the current GPU (one GPU a process), 128 where
    DeepGEMM failed its check (:func:`fp8_linear`'s ``"deep_gemm"`` asked for all the same)."""
    return deep_gemm_n_alignment() or 128


def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, backend: str = "triton"
) -> torch.Tensor:
    """x [..., K] (bf16/fp16) -> [..., N] in x's dtype through ``backend``
    (:data:`FP8_LINEAR_BACKENDS`); ``"deep_gemm"`` runs Triton for shapes DeepGEMM does not
    take (:func:`deep_gemm_fits`)."""
    if backend == "torch":
        return fp8_linear_ref(x, weight, scale_inv)
    if backend not in FP8_LINEAR_BACKENDS:
        raise ValueError(f"backend must be one of {FP8_LINEAR_BACKENDS}, got {backend!r}")
    lead, k = x.shape[:-1], x.shape[-1]
    n = weight.shape[0]
    x2d = x.reshape(-1, k)
    if backend == "deep_gemm" and deep_gemm_fits(n, k, x.dtype, _n_align()):
        return _deep_gemm_linear(x2d, weight, scale_inv).view(*lead, n)
    from dsmesh.kernels.fp8_quant import per_token_group_quant_fp8

    a, a_scale = per_token_group_quant_fp8(_pad_groups(x2d), BLOCK)
    return fp8_block_gemm(a, a_scale, weight, scale_inv, x.dtype).view(*lead, n)
