"""MLA decode attention backends: one interface, chosen once at engine start.

A decode row attends its single new token's query over the request's whole paged latent
context (weight-absorbed MLA). Every backend takes the same :class:`DecodeMeta` (a paged
page table and lengths, on the device, plus their host copy for backends that plan there)
and the same call, so the eager forward and the captured one run the same code:

- :class:`TorchMLADecode`: the reference (dsmesh.kernels.mla_decode.mla_decode_ref, float32 scores);
- :class:`TritonMLADecode`: dsmesh's split-K Triton kernel (dsmesh.kernels.mla_decode);
- :class:`FlashInferMLADecode`: FlashInfer's paged MLA kernel (optional library), which plans
  its schedule on the host: :meth:`MLADecodeBackend.plan` before an eager forward,
  :meth:`MLADecodeBackend.prepare_replay` before a CUDA graph's replay (and its capture).

``"auto"`` takes FlashInfer where dsmesh.kernels.backends has a tested adapter, it is installed
at the tested release (dsmesh.kernels.libraries), the dtype is bf16/fp16 and the cache holds
DeepSeek's latent (512 + 64, the shape its kernels are built and tested for); it builds the
kernel at once (FlashInfer compiles on first use) and falls back to Triton with a warning when
that fails; an explicit "flashinfer" raises instead, naming the release to install.

A pool in the FP8 page format (``--kv-cache-dtype fp8_e4m3``) passes its layer's scales as
``kv_scales``: the torch reference dequantises the tokens a step reads in float32, the
Triton kernel reads the codes and folds the scales in (dsmesh.kernels.mla_decode);
FlashInfer does not read this format (EngineConfig refuses the combination, "auto" never
takes it since the cache dtype is not bf16/fp16).
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod

import numpy as np
import torch

from dsmesh.engine.model.forward_batch import DecodeMeta
from dsmesh.kernels.backends import available, choose
from dsmesh.kernels.libraries import FLASHINFER_DIST, FLASHINFER_TESTED, SETUP_HINT
from dsmesh.kernels.libraries import status as library_status
from dsmesh.kernels.mla_decode import mla_decode_ref

log = logging.getLogger(__name__)

# The engine's setting; "kernel" is dsmesh's Triton kernel, "torch" its reference.
ATTENTION_BACKENDS = ("auto", "kernel", "flashinfer", "torch")
DEEPSEEK_LATENT = (512, 64)  # kv_lora_rank, qk_rope_head_dim


class MLADecodeBackend(ABC):
    """Contract: ``forward(q_latent [D, H, C], q_pe [D, H, R], kv [pages, page_size, C + R],
    meta, scale, out, kv_scales)`` -> [D, H, C] in q's dtype, the softmax over the first
    ``meta.seq_lens[d]`` cached tokens of request ``d`` (zeros for an empty context). ``q``
    and ``out`` may be strided views with a dense last dim. With ``kv_scales`` [pages,
    page_size, 2] float32, ``kv`` is float8_e4m3fn (the FP8 page format: the latent's and
    the rope key's scale per token, :mod:`dsmesh.kernels.kv_fp8`). ``forward`` never synchronises
    with the host, so a captured forward can call it; the host work, if any, is in
    ``plan`` / ``prepare_replay``, which the caller runs before the forward.
    ``plans_on_host``: that work reads the step's lengths, so a replay whose positions are
    computed on the device (a speculative step's chained drafts) cannot use the backend."""

    name: str
    plans_on_host: bool = False

    def plan(self, meta: DecodeMeta) -> None:
        """Before an eager forward whose decode rows are ``meta`` (``meta.host`` is set)."""
        return None

    def prepare_capture(self, batch_size: int) -> None:
        """Before capturing a graph of ``batch_size`` decode rows."""
        return None

    def prepare_replay(self, page_table: np.ndarray, seq_lens: np.ndarray) -> None:
        """Before replaying (or capturing) a graph, with that step's host page table
        [B, P] and lengths [B]."""
        return None

    @abstractmethod
    def forward(
        self,
        q_latent: torch.Tensor,
        q_pe: torch.Tensor,
        kv: torch.Tensor,
        meta: DecodeMeta,
        scale: float,
        out: torch.Tensor | None = None,
        kv_scales: torch.Tensor | None = None,
    ) -> torch.Tensor: ...


class TorchMLADecode(MLADecodeBackend):
    name = "torch"

    def forward(self, q_latent, q_pe, kv, meta, scale, out=None, kv_scales=None):
        pt, lens = meta.page_table, meta.seq_lens
        return mla_decode_ref(q_latent, q_pe, kv, pt, lens, scale, out, kv_scales=kv_scales)


class TritonMLADecode(MLADecodeBackend):
    name = "triton"

    def __init__(self) -> None:
        from dsmesh.kernels.mla_decode import mla_decode  # Triton is imported here, once

        self._kernel = mla_decode

    def forward(self, q_latent, q_pe, kv, meta, scale, out=None, kv_scales=None):
        pt, lens = meta.page_table, meta.seq_lens
        return self._kernel(q_latent, q_pe, kv, pt, lens, scale, out=out, kv_scales=kv_scales)


class FlashInferMLADecode(MLADecodeBackend):
    """Two FlashInfer kernels: one planned per eager forward (any batch size), and one with
    a capturable wrapper per graph bucket, re-planned before each replay."""

    name = "flashinfer"
    plans_on_host = True

    def __init__(
        self,
        device: torch.device,
        num_heads: int,
        kv_lora_rank: int,
        rope_dim: int,
        page_size: int,
        dtype: torch.dtype,
        scale: float,
        max_pages_per_request: int,
    ) -> None:
        if device.type != "cuda":
            raise ValueError("attention='flashinfer' needs CUDA")
        if not available("flashinfer"):
            raise ValueError(
                "attention='flashinfer' but FlashInfer is not installed "
                f"(pip install {FLASHINFER_DIST}=={FLASHINFER_TESTED}, or {SETUP_HINT})"
            )
        installed = library_status("flashinfer")
        if not installed.usable:  # an untested release: "auto" would have kept Triton
            raise ValueError(f"attention='flashinfer': {installed.detail}")
        from dsmesh.kernels.mla_decode_flashinfer import FlashInferMLADecode as Kernel

        shape = (device, num_heads, kv_lora_rank, rope_dim, page_size, dtype, scale)
        self.eager = Kernel(*shape, max_pages_per_request, graph=False)
        self.graphed = Kernel(*shape, max_pages_per_request, graph=True)
        self.eager.warm_up()  # compiles now, so a missing compiler fails at start-up
        self._active = self.eager

    def plan(self, meta: DecodeMeta) -> None:
        if meta.host is None:
            raise ValueError("FlashInfer plans on the host: DecodeMeta.host is needed")
        self.eager.plan(*meta.host)
        self._active = self.eager

    def prepare_replay(self, page_table: np.ndarray, seq_lens: np.ndarray) -> None:
        self.graphed.plan(page_table, seq_lens)
        self._active = self.graphed

    def forward(self, q_latent, q_pe, kv, meta, scale, out=None, kv_scales=None):
        if kv_scales is not None:
            raise ValueError("FlashInfer's MLA decode does not read FP8 KV pages")
        return self._active(q_latent, q_pe, kv, meta.page_table, meta.seq_lens, scale, out=out)


def flashinfer_fits(head_dims: tuple[int, int], device: torch.device, dtype: torch.dtype) -> bool:
    """Whether "auto" should try FlashInfer: a tested adapter for an installed FlashInfer,
    CUDA, a bf16/fp16 cache (``dtype``: the pool's values; not FP8) and DeepSeek's latent
    (``head_dims`` = kv_lora_rank, rope dim)."""
    return (
        device.type == "cuda"
        and dtype in (torch.bfloat16, torch.float16)
        and head_dims == DEEPSEEK_LATENT
        and choose("mla_decode") == "flashinfer"
    )


def make_decode_backend(
    name: str,
    requested: str,
    device: torch.device,
    shape: tuple[int, int, int, float],
    dtype: torch.dtype,
    page_size: int,
    max_pages_per_request: int,
) -> MLADecodeBackend:
    """The backend ``name`` ("torch", "triton", "flashinfer"; KernelChoice.decode_attention)
    for heads, kv_lora_rank, rope dim and softmax scale ``shape``. FlashInfer that fails to
    build falls back to Triton when ``requested`` was "auto"."""
    if name == "torch":
        return TorchMLADecode()
    if name == "triton":
        return TritonMLADecode()
    if name != "flashinfer":
        raise ValueError(f"unknown decode attention backend {name!r}")
    heads, rank, rope, scale = shape
    try:
        return FlashInferMLADecode(
            device, heads, rank, rope, page_size, dtype, scale, max_pages_per_request
        )
    except Exception as exc:  # e.g. no CUDA compiler for its first-use build
        if requested != "auto":
            raise
        log.warning("FlashInfer MLA decode unavailable (%s); using Triton", exc)
        return TritonMLADecode()
