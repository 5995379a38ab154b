"""Suite-wide set-up that must happen before any test module is imported."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    # Without a GPU, tests/kernels runs the Triton kernels in Triton's CPU interpreter. The
    # choice is read when triton is first imported, and transformers imports it, so it is
    # made here, before any test module loads. The engine never runs Triton on the CPU.
    os.environ.setdefault("TRITON_INTERPRET", "1")
