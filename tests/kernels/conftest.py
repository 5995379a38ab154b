"""Kernel tests run on the GPU when there is one; otherwise the Triton kernels run at small
shapes in Triton's CPU interpreter (when Triton is installed) and the references run alone."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
HAS_TRITON = importlib.util.find_spec("triton") is not None


def _patch_interpreter_index() -> None:
    """Triton 3.6's interpreter holds scalars as 1-element arrays and converts them with
    ``int(array)``, which NumPy >= 2.4 refuses for arrays of one dimension; a loop bound read
    from memory (``range(start, end)``) then fails. Convert through ``.item()`` instead."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def patched(tensor, scope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    interpreter._patch_lang_tensor = patched


if HAS_TRITON and not HAS_CUDA:
    # tests/conftest.py sets TRITON_INTERPRET=1 before anything imports triton.
    assert os.environ.get("TRITON_INTERPRET") == "1", "tests/conftest.py must run first"
    _patch_interpreter_index()

needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
needs_triton = pytest.mark.skipif(
    not HAS_TRITON, reason="needs triton (GPU, or its CPU interpreter)"
)


@pytest.fixture
def device() -> str:
    """Where the Triton kernels run: the GPU, else the CPU interpreter."""
    return "cuda" if HAS_CUDA else "cpu"


def assert_fp8_codes_equal(
    q: torch.Tensor, q_ref: torch.Tensor, neighbours_ok: bool = False
) -> None:
    """FP8 tensors hold the same codes. Triton 3.6's CPU interpreter rounds float32 -> e4m3
    sloppily: halfway cases go to the odd neighbour, and a rounding that carries into the next
    power of two keeps the lower binade (125.7 gives 64, not 128). Under the interpreter, and
    only there, codes may differ in those two ways. On the GPU every code must match, or be
    a neighbour when ``neighbours_ok`` (inputs computed with a last-ulp difference)."""
    q, q_ref = q.cpu(), q_ref.cpu()
    differ = q.view(torch.uint8) != q_ref.view(torch.uint8)
    if (HAS_CUDA and not neighbours_ok) or not differ.any():
        assert not differ.any(), f"{int(differ.sum())} of {differ.numel()} FP8 codes differ"
        return
    got, want = q[differ].float(), q_ref[differ].float()
    mantissa, _ = torch.frexp(want)
    carry = (mantissa.abs() == 0.5) & (got / want >= 0.5) & (got / want < 1)
    codes = q.view(torch.uint8)[differ].int(), q_ref.view(torch.uint8)[differ].int()
    neighbour = (codes[0] - codes[1]).abs() == 1
    ok = neighbour if HAS_CUDA else carry | neighbour
    assert ok.all(), list(zip(got[~ok].tolist(), want[~ok].tolist(), strict=True))[:5]
