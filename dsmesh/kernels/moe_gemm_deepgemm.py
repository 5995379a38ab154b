"""DeepGEMM's FP8 grouped GEMM (optional backend) for dsmesh's FP8 experts.

DeepGEMM's "M-grouped contiguous" GEMM wants every expert's rows to start on a multiple of
its alignment (128 rows on Hopper) and a per-row expert index (``grouped_layout``, -1 on
padding rows). dsmesh's rows are grouped by expert without gaps, so
:func:`deepgemm_expert_ffn_fp8` scatters them once into a padded buffer, runs the whole expert
FFN there (gate/up GEMM, fused silu*up + quantise, down GEMM) and gathers the rows back once;
:func:`deepgemm_fp8_grouped_gemm` is one GEMM with
:func:`dsmesh.kernels.moe_gemm.fp8_grouped_gemm`'s
contract. Everything is computed on the device with shapes that depend only on ``M`` and the
expert count (``M + E * (align - 1)`` rows, rounded up), so nothing waits for the GPU and the
calls can be captured in a CUDA graph. Padding rows are never initialised: no real row reads
them.

Weights stay as the checkpoint stores them (e4m3, 128x128 float32 block scales); activations
are dsmesh's per-token groups of 128 (float32 scales), DeepGEMM's (1, 128, 128) recipe.
DeepGEMM comes from ``pip install dsmesh[deepgemm]`` (SGLang's ``sgl-deep-gemm`` build),
imported lazily.

Which builds work: ``sgl-deep-gemm`` ships one prebuilt host library per release, compiled
against one torch; it reads torch tensors through torch's inline accessors, so a release built
against another torch imports and then misreads them (it asserts ``dim == 2 or dim == 3`` on a
2-D tensor). With torch 2.11 (the H200 image) 0.1.0, 0.1.3 and 0.1.5 work, 0.1.5.post3 and
later do not (docs/KERNELS.md); dsmesh.kernels.libraries records which torch each release was
built for, and a release built for another torch is not imported at all
(dsmesh.kernels.backends). :func:`load_deep_gemm` still checks the build before first use.

When it runs: :func:`prefers_deep_gemm`, a pure function of the problem's static shape. Every
expert's rows are padded to a 128-row block, so with few rows per expert (decode) DeepGEMM
multiplies mostly padding and dsmesh's Triton kernel, which sizes its row blocks to the
problem, is faster; with many (prefill) DeepGEMM is (docs/BENCHMARKS.md, crossover rows).
"""

from __future__ import annotations

import functools
import logging
import math
from types import ModuleType

import torch

from dsmesh.kernels.fp8 import BLOCK, Fp8ExpertWeights
from dsmesh.kernels.libraries import install_hint

log = logging.getLogger(__name__)

__all__ = [
    "MIN_ROWS_PER_EXPERT",
    "deepgemm_expert_ffn_fp8",
    "deepgemm_fp8_grouped_gemm",
    "load_deep_gemm",
    "padded_layout",
    "prefers_deep_gemm",
    "reads_tensors_correctly",
]

# Mean routed rows per expert from which DeepGEMM's expert FFN beats the Triton one on the
# H200 (dsmesh.bench.kernels --only moe_fp8_crossover; docs/BENCHMARKS.md): V3 widths 0.90x at 128
# and 1.10x at 256 rows per expert, V2-Lite widths 0.86x at 96 and 1.02x at 192.
MIN_ROWS_PER_EXPERT = 192


@functools.cache
def load_deep_gemm() -> ModuleType | None:
    """The ``deep_gemm`` module, or None (logged once) when it is missing, fails to load, or
    fails :func:`reads_tensors_correctly` on the current CUDA device."""
    try:
        import deep_gemm
    except Exception as exc:  # ImportError, or its library failing to load against this torch
        log.warning("DeepGEMM unavailable (%s); FP8 experts use the Triton grouped GEMM", exc)
        return None
    problem = reads_tensors_correctly(deep_gemm, "cuda")
    if problem:
        log.warning(
            "DeepGEMM %s is installed but unusable with torch %s (%s): its prebuilt library "
            "was built against another torch (docs/KERNELS.md); %s. FP8 experts use the "
            "Triton grouped GEMM",
            getattr(deep_gemm, "__file__", "?"),
            torch.__version__,
            problem,
            install_hint("deep_gemm", torch.__version__, torch.version.cuda),
        )
        return None
    return deep_gemm


def reads_tensors_correctly(deep_gemm: ModuleType, device: str) -> str:
    """Empty when DeepGEMM's host library reads a torch tensor right, else what went wrong.

    A build against another torch imports fine and then misreads every tensor (it asserts
    ``dim == 2 or dim == 3`` on a 2-D one), which would take a serving process down at its
    first large prefill; so a small layout call (transpose a [128, 4] float32 tensor into
    DeepGEMM's MN-major scale layout) is checked once, before the first use."""
    try:
        x = torch.arange(128 * 4, dtype=torch.float32, device=device).view(128, 4)
        y = deep_gemm.get_mn_major_tma_aligned_tensor(x)
        if tuple(y.shape) != (128, 4) or not bool(torch.equal(y.cpu(), x.cpu())):
            return f"its layout call returned shape {tuple(y.shape)} and other values"
    except Exception as exc:
        return f"{type(exc).__name__}: {str(exc)[:200]}"
    return ""


def prefers_deep_gemm(
    num_rows: int, num_experts: int, min_rows_per_expert: int = MIN_ROWS_PER_EXPERT
) -> bool:
    """Whether a grouped GEMM of ``num_rows`` routed rows over ``num_experts`` experts should
    run on DeepGEMM: only when the experts average ``min_rows_per_expert`` rows or more. The
    shapes are static, so a CUDA graph captures one choice per bucket."""
    return num_experts > 0 and num_rows >= min_rows_per_expert * num_experts


def padded_layout(
    tokens_per_expert: torch.Tensor, num_rows: int, align: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(``dst`` [M] int64, ``grouped_layout`` [M_max] int32) for rows grouped by expert.

    Row ``r`` of expert ``e`` goes to ``dst[r]`` in a buffer where expert ``e``'s segment
    starts at a multiple of ``align`` and spans its rows rounded up to ``align``;
    ``grouped_layout`` is ``e`` at its rows and -1 at every padding row (DeepGEMM's own
    convention). ``M_max`` is ``M + E * (align - 1)`` rounded up to ``align``: the most any
    routing can need.
    """
    counts = tokens_per_expert.to(torch.int64)
    num_experts = counts.shape[0]
    padded = (counts + align - 1) // align * align
    pad_ends = padded.cumsum(0)
    ends = counts.cumsum(0)
    rows = torch.arange(num_rows, device=counts.device)
    expert = torch.searchsorted(ends, rows, right=True)
    dst = (pad_ends - padded)[expert] + rows - (ends - counts)[expert]
    m_max = math.ceil((num_rows + num_experts * (align - 1)) / align) * align
    layout = torch.full((m_max,), -1, dtype=torch.int32, device=counts.device)
    layout.index_copy_(0, dst, expert.to(torch.int32))
    return dst, layout


def _scatter_rows(src: torch.Tensor, dst: torch.Tensor, num_rows: int) -> torch.Tensor:
    """``src`` [M, C] rows placed at rows ``dst`` of a new [num_rows, C] buffer (other rows
    uninitialised). Rows are copied as 8-byte words where they allow it: ``index_copy_`` moves
    one element per thread, and one-byte FP8 elements made it the adapter's largest cost."""
    out = torch.empty((num_rows, src.shape[1]), dtype=src.dtype, device=src.device)
    if src.shape[1] * src.element_size() % 8 == 0:
        out.view(torch.int64).index_copy_(0, dst, src.contiguous().view(torch.int64))
    else:
        out.view(torch.uint8).index_copy_(0, dst, src.contiguous().view(torch.uint8))
    return out


def _gather_rows(src: torch.Tensor, rows: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out`` [M, C] = ``src[rows]``, copied as 8-byte words where the row width allows."""
    if src.shape[1] * src.element_size() % 8 == 0:
        torch.index_select(src.view(torch.int64), 0, rows, out=out.view(torch.int64))
    else:
        torch.index_select(src, 0, rows, out=out)
    return out


def _padded_inputs(
    deep_gemm: ModuleType, a: torch.Tensor, a_scale: torch.Tensor, tokens_per_expert: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Expert-grouped FP8 rows and their scales scattered into DeepGEMM's padded layout:
    (a_pad, a_scale_pad, grouped_layout, dst) with ``dst[r]`` the padded row of row ``r``."""
    align = int(deep_gemm.get_mk_alignment_for_contiguous_layout())
    dst, layout = padded_layout(tokens_per_expert, a.shape[0], align)
    m_max = layout.shape[0]
    return _scatter_rows(a, dst, m_max), _scatter_rows(a_scale, dst, m_max), layout, dst


def _grouped(deep_gemm: ModuleType, a, a_scale, w, w_scale, layout, out_dtype) -> torch.Tensor:
    """DeepGEMM's M-grouped contiguous GEMM on rows already in its padded layout."""
    d = torch.empty((a.shape[0], w.shape[1]), dtype=out_dtype, device=a.device)
    deep_gemm.m_grouped_fp8_gemm_nt_contiguous((a, a_scale), (w, w_scale), d, layout)
    return d


def _require(out_dtype: torch.dtype) -> ModuleType:
    deep_gemm = load_deep_gemm()
    if deep_gemm is None:
        raise RuntimeError("deep_gemm is not importable here")
    if out_dtype != torch.bfloat16:
        raise ValueError(f"DeepGEMM's grouped GEMM writes bfloat16, not {out_dtype}")
    return deep_gemm


def deepgemm_fp8_grouped_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Same call and result as :func:`dsmesh.kernels.moe_gemm.fp8_grouped_gemm`, through DeepGEMM:
    a [M, K] e4m3 grouped by expert, a_scale [M, K/128]; w [E, N, K] e4m3, w_scale
    [E, N/128, K/128] -> [M, N] (bf16 output only)."""
    deep_gemm = _require(out_dtype)
    m = a.shape[0]
    out = torch.empty((m, w.shape[1]), dtype=out_dtype, device=a.device)
    if m == 0:
        return out
    a_pad, scale_pad, layout, dst = _padded_inputs(deep_gemm, a, a_scale, tokens_per_expert)
    d = _grouped(deep_gemm, a_pad, scale_pad, w, w_scale, layout, out_dtype)
    return _gather_rows(d, dst, out)


def deepgemm_expert_ffn_fp8(
    hidden: torch.Tensor, tokens_per_expert: torch.Tensor, weights: Fp8ExpertWeights
) -> torch.Tensor:
    """:func:`dsmesh.kernels.moe_gemm.expert_ffn_fp8` through DeepGEMM, staying in its padded layout
    between the two GEMMs: rows are scattered once (as FP8, after quantisation) and gathered
    once (the down projection's output). The fused silu*up + quantise runs on the padded
    rows too; padding rows hold garbage that no real row ever reads."""
    from dsmesh.kernels.fp8_quant import per_token_group_quant_fp8, silu_mul_quant_fp8

    deep_gemm = _require(hidden.dtype)
    m = hidden.shape[0]
    out = torch.empty_like(hidden)
    if m == 0:
        return out
    a, a_scale = per_token_group_quant_fp8(hidden, BLOCK)
    a_pad, scale_pad, layout, dst = _padded_inputs(deep_gemm, a, a_scale, tokens_per_expert)
    gate_up = _grouped(
        deep_gemm, a_pad, scale_pad, weights.w13, weights.w13_scale, layout, hidden.dtype
    )
    h, h_scale = silu_mul_quant_fp8(gate_up, BLOCK)
    down = _grouped(deep_gemm, h, h_scale, weights.w2, weights.w2_scale, layout, hidden.dtype)
    return _gather_rows(down, dst, out)
