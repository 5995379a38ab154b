"""DeepGEMM's FP8 grouped GEMM (optional backend) behind
:func:`kernels.moe_gemm.fp8_grouped_gemm`'s contract.

DeepGEMM's "M-grouped contiguous" GEMM wants every expert's rows to start on a multiple of
its alignment (128 rows on Hopper) and a per-row expert index (``grouped_layout``, -1 past
the last expert). dsmesh's rows are grouped by expert without gaps, so the adapter scatters
them into a padded buffer and gathers the products back. Everything is computed on the
device with shapes that depend only on ``M`` and the expert count (``M + E * (align - 1)``
rows, rounded up), so nothing waits for the GPU and the call can be captured in a CUDA
graph. Padding rows of the inputs are never initialised: their products are discarded.

Weights stay as the checkpoint stores them (e4m3, 128x128 float32 block scales); activations
are dsmesh's per-token groups of 128 (float32 scales), DeepGEMM's (1, 128, 128) recipe.
DeepGEMM comes from ``pip install sgl-deep-gemm`` (SGLang's build of it), imported lazily.

Status: not wired into the engine (kernels.backends does not list it). On the H200 with torch
2.11, ``sgl-deep-gemm`` 0.2.0 imported, and its grouped GEMM raised ``Assertion error
(.../utils/layout.hpp:16): dim == 2 or dim == 3`` on this call. That build pins
``apache-tvm-ffi==0.1.11`` and the run had 0.1.15.post2 (FlashInfer's), a suspect not yet
ruled out; 0.2.1 and later need a newer torch (docs/KERNELS.md). The layout is tested on CPU.
"""

from __future__ import annotations

import functools
import logging
import math
from types import ModuleType

import torch

log = logging.getLogger(__name__)

__all__ = ["deepgemm_fp8_grouped_gemm", "load_deep_gemm", "padded_layout"]


@functools.cache
def load_deep_gemm() -> ModuleType | None:
    """The ``deep_gemm`` module, or None (logged once) when it is missing or fails to load."""
    try:
        import deep_gemm
    except Exception as exc:  # ImportError, or its library failing to load against this torch
        log.warning("DeepGEMM unavailable (%s); FP8 experts use the Triton grouped GEMM", exc)
        return None
    return deep_gemm


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
    counts = tokens_per_expert.to(device=tokens_per_expert.device, dtype=torch.int64)
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


def deepgemm_fp8_grouped_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Same call and result as :func:`kernels.moe_gemm.fp8_grouped_gemm`, through DeepGEMM:
    a [M, K] e4m3 grouped by expert, a_scale [M, K/128]; w [E, N, K] e4m3, w_scale
    [E, N/128, K/128] -> [M, N] (bf16 output only)."""
    deep_gemm = load_deep_gemm()
    if deep_gemm is None:
        raise RuntimeError("deep_gemm is not importable here")
    if out_dtype != torch.bfloat16:
        raise ValueError(f"DeepGEMM's grouped GEMM writes bfloat16, not {out_dtype}")
    m, k = a.shape
    n = w.shape[1]
    out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0:
        return out
    align = int(deep_gemm.get_mk_alignment_for_contiguous_layout())
    dst, layout = padded_layout(tokens_per_expert, m, align)
    m_max = layout.shape[0]
    a_pad = torch.empty((m_max, k), dtype=a.dtype, device=a.device)
    a_pad.view(torch.uint8).index_copy_(0, dst, a.view(torch.uint8))  # no fp8 index_copy_
    scale_pad = torch.empty((m_max, a_scale.shape[1]), dtype=a_scale.dtype, device=a.device)
    scale_pad.index_copy_(0, dst, a_scale)
    d = torch.empty((m_max, n), dtype=out_dtype, device=a.device)
    deep_gemm.m_grouped_fp8_gemm_nt_contiguous((a_pad, scale_pad), (w, w_scale), d, layout)
    return torch.index_select(d, 0, dst, out=out)
