"""The kernel libraries a CUDA engine imports when it chooses its kernels, imported on a
thread while its weights load.

Reading the checkpoint to the GPU is file reads and copies that release the GIL, and Triton
and FlashInfer take a large part of a second to import, so the two overlap: the engine
starts :class:`ImportsAhead` before its weights phase and waits for it before it sizes its
KV pool (docs/RELIABILITY.md, Restart time). Only modules the engine would import anyway are
listed (:func:`kernel_modules`, the rules of ``ModelRunner.set_kernels``), so nothing new is
loaded; one that fails to import here is
imported again by the kernel choice, which reports the error as it always did.
"""

from __future__ import annotations

import importlib
import logging
import sys
import threading
from collections.abc import Sequence

import torch

from dsmesh.engine.kv.pool import kv_cache_dtype
from dsmesh.engine.model.config import ModelConfig
from dsmesh.engine.model.mla_decode_backend import flashinfer_fits
from dsmesh.engine.options import EngineConfig
from dsmesh.kernels._triton import triton_importable

log = logging.getLogger(__name__)


def kernel_modules(config: EngineConfig, device: torch.device, mc: ModelConfig) -> list[str]:
    """The third-party kernel modules that an engine with ``config`` on ``device`` for the
    model ``mc`` imports when it chooses its kernels (``ModelRunner.set_kernels``): Triton on
    CUDA with ``kernels="auto"``, and FlashInfer when it serves the MLA decode. None on the
    CPU."""
    if device.type != "cuda" or config.kernels != "auto" or not triton_importable():
        return []
    modules = ["triton", "triton.language"]
    pool_dtype = kv_cache_dtype(config.kv_cache_dtype, config.resolved_dtype())
    fits = flashinfer_fits((mc.mla.kv_lora_rank, mc.mla.qk_rope_head_dim), device, pool_dtype)
    # two-batch overlap keeps the MLA decode on Triton (a FlashInfer plan covers one batch)
    wanted = config.decode_attention == "flashinfer" or (config.decode_attention == "auto" and fits)
    if wanted and not config.tbo:
        modules.append("flashinfer")
    return modules


class ImportsAhead:
    """Imports ``modules`` (those not loaded yet) on a daemon thread, in order, from
    construction; :meth:`wait` returns once it is done. The caller must not import them
    itself meanwhile (it waits first)."""

    def __init__(self, modules: Sequence[str]) -> None:
        self.modules = tuple(name for name in modules if name not in sys.modules)
        self.failed: dict[str, str] = {}  # module -> the error its import raised here
        self._thread: threading.Thread | None = None
        if self.modules:
            self._thread = threading.Thread(target=self._run, name="imports-ahead", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        for name in self.modules:
            try:
                importlib.import_module(name)
            except Exception as exc:  # the kernel choice imports it again and says why
                self.failed[name] = f"{type(exc).__name__}: {exc}"
                log.debug("importing %s ahead failed: %s", name, exc)

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
