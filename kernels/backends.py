"""Optional third-party kernels: FlashInfer (MLA attention) and DeepGEMM (grouped FP8 GEMM).

Both are looked up lazily (never imported at start-up, never required). The GPU machine this
project measures on has neither, so no adapter to them has been run, and dsmesh does not call
them yet: :func:`choose` returns ``"triton"`` for every kernel and logs once per kernel which
optional library it found, so a deployment that installs one sees that the hook is there.
An adapter goes in :data:`_ADAPTERS` once it can be tested on a machine that has the library.
"""

from __future__ import annotations

import functools
import importlib.util
import logging

log = logging.getLogger(__name__)

# kernel name -> the optional module that could serve it
OPTIONAL = {"mla_decode": "flashinfer", "mla_prefill": "flashinfer", "moe_fp8_gemm": "deep_gemm"}
# kernel name -> adapters proven on a GPU with the library installed (none yet)
_ADAPTERS: dict[str, str] = {}


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
