"""Lazy Triton access: importing ``kernels`` never needs Triton.

Kernel modules build their ``@triton.jit`` functions inside a cached factory, so Triton is
imported (and ``TRITON_INTERPRET`` read) only at the first launch. Which kernels the model
runs is chosen once per engine (dsmesh/engine/model/kernel_choice.py); :func:`use_triton` is only
the device rule of helpers below that choice (a CUDA tensor and an importable Triton). Tests may
run the same kernels on the CPU under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os

import torch

log = logging.getLogger(__name__)


@functools.cache
def triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """Whether Triton kernels run in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def use_triton(t: torch.Tensor) -> bool:
    """Triton kernels for CUDA tensors when Triton is there; torch otherwise (no environment
    read: the engine's ``kernels="torch"`` forces the references where it matters)."""
    return t.is_cuda and triton_importable()


def can_launch(t: torch.Tensor) -> bool:
    """Whether a Triton kernel can run on ``t``: on its GPU, or on the CPU when interpreting."""
    return triton_importable() and (t.is_cuda or interpreting())


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@functools.cache
def log_once(message: str) -> None:
    log.info(message)
