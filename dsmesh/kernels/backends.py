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

- ``fp8_linear``: DeepGEMM's dense FP8 GEMM (``fp8_gemm_nt``, dsmesh.kernels.fp8_linear) for the
  linear layers held in FP8 (attention projections, shared experts), every batch size.

MLA prefill has no adapter (no measured need: the Triton kernel runs prefill at 54-58% of the
matmul rate).

An installed library is used only when its build fits this torch and is a tested release
(:func:`dsmesh.kernels.libraries.status`): otherwise :func:`decide` logs a warning naming the
release to install (``pip install ...`` or ``bash scripts/setup-gpu.sh``) and keeps Triton.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
from dataclasses import dataclass

from dsmesh.kernels.libraries import status as library_status

log = logging.getLogger(__name__)

# kernel name -> the optional module that could serve it
OPTIONAL = {
    "mla_decode": "flashinfer",
    "mla_prefill": "flashinfer",
    "moe_fp8_gemm": "deep_gemm",
    "fp8_linear": "deep_gemm",
}
# kernel name -> the adapter module, tested on a GPU with the library installed
_ADAPTERS: dict[str, str] = {
    "mla_decode": "dsmesh.kernels.mla_decode_flashinfer",
    "moe_fp8_gemm": "dsmesh.kernels.moe_gemm_deepgemm",
    "fp8_linear": "dsmesh.kernels.fp8_linear",
}


@dataclass(frozen=True)
class Decision:
    """``backend``: ``"triton"`` or the optional module that runs the kernel; ``why``: one
    line for the start-up summary ("flashinfer-python 0.6.18.post1", "flashinfer not
    installed (...)", or why an installed build was refused)."""

    backend: str
    why: str


@functools.cache
def available(module: str) -> bool:
    """Whether ``module`` can be imported (found on the path; not imported here)."""
    return importlib.util.find_spec(module) is not None


@functools.cache
def decide(kernel: str) -> Decision:
    """The backend that runs ``kernel`` and why: ``"triton"`` (dsmesh's own) unless a tested
    adapter exists for an installed optional library whose build fits this torch. Logged
    once per kernel; a refused build as a warning that names the release to install."""
    module = OPTIONAL.get(kernel)
    if module is None:
        log.info("%s: using dsmesh's Triton kernel", kernel)
        return Decision("triton", "dsmesh's kernel")
    if not available(module):
        log.info("%s: using dsmesh's Triton kernel (%s not installed)", kernel, module)
        return Decision("triton", f"{module} not installed")
    if kernel not in _ADAPTERS:
        log.info("%s: %s is installed but has no tested adapter here; using Triton", kernel, module)
        return Decision("triton", f"no {module} adapter for {kernel}")
    lib = library_status(module)
    if not lib.usable:
        log.warning("%s: %s; using dsmesh's Triton kernel", kernel, lib.detail)
        return Decision("triton", lib.detail)
    log.info("%s: using %s (%s)", kernel, module, lib.detail)
    return Decision(module, lib.detail)


def choose(kernel: str) -> str:
    """:func:`decide`'s backend for ``kernel``."""
    return decide(kernel).backend
