"""Optional third-party kernels: FlashInfer (MLA attention) and DeepGEMM (grouped FP8 GEMM).

Both are looked up lazily (never imported at start-up, never required). :func:`choose` names
the library for a kernel when it is installed and an adapter to it has been tested on a GPU
with the library (:data:`_ADAPTERS`), else ``"triton"`` (dsmesh's own kernels); it logs the
choice once per kernel. Adapters so far:

- ``mla_decode``: FlashInfer's MLA paged decode (dsmesh.kernels.mla_decode_flashinfer), used by the
  CUDA-graph decode path for DeepSeek's latent shape (512 + 64); see docs/KERNELS.md.

- ``moe_fp8_gemm``: DeepGEMM's M-grouped contiguous FP8 GEMM (dsmesh.kernels.moe_gemm_deepgemm),
  used by FP8 experts for problems with many rows per expert (prefill); see
  :func:`dsmesh.kernels.moe_gemm_deepgemm.prefers_deep_gemm`.

MLA prefill has no adapter (no measured need: the Triton kernel runs prefill at 54-58% of the
matmul rate).
"""

from __future__ import annotations

import functools
import importlib.util
import logging

log = logging.getLogger(__name__)

# kernel name -> the optional module that could serve it
OPTIONAL = {"mla_decode": "flashinfer", "mla_prefill": "flashinfer", "moe_fp8_gemm": "deep_gemm"}
# kernel name -> the adapter module, tested on a GPU with the library installed
_ADAPTERS: dict[str, str] = {
    "mla_decode": "dsmesh.kernels.mla_decode_flashinfer",
    "moe_fp8_gemm": "dsmesh.kernels.moe_gemm_deepgemm",
}


@functools.cache
def available(module: str) -> bool:
    """Whether ``module`` can be imported (found on the path; not imported here)."""
    return importlib.util.find_spec(module) is not None


@functools.cache
def choose(kernel: str) -> str:
    """The backend that runs ``kernel``: ``"triton"`` (dsmesh's own) unless a tested adapter
    for an installed optional library exists. Logged once per kernel."""
    module = OPTIONAL.get(kernel)
    if module is not None and available(module) and kernel in _ADAPTERS:
        log.info("%s: using %s", kernel, module)
        return module
    if module is not None and available(module):
        log.info("%s: %s is installed but has no tested adapter here; using Triton", kernel, module)
    else:
        log.info("%s: using dsmesh's Triton kernel", kernel)
    return "triton"
