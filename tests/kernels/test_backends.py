"""Optional backends are looked up lazily and fall back to the Triton kernels; an installed
build that does not fit this torch, or is an untested release, is refused with the release
to install (dsmesh/kernels/libraries.py decides; its statuses are faked here)."""

from __future__ import annotations

import logging

import pytest

from dsmesh.kernels import backends
from dsmesh.kernels.libraries import Installed, LibraryStatus


@pytest.fixture(autouse=True)
def _fresh_decisions():
    backends.decide.cache_clear()
    yield
    backends.decide.cache_clear()


def _status(module: str, usable: bool, detail: str) -> LibraryStatus:
    return LibraryStatus(module, Installed("x", "1"), usable, detail, "fix")


def test_missing_library_means_triton_and_is_logged_once(caplog, monkeypatch) -> None:
    monkeypatch.setitem(backends.OPTIONAL, "fake_kernel", "surely_not_an_installed_module_x")
    with caplog.at_level(logging.INFO, logger="dsmesh.kernels.backends"):
        assert backends.choose("fake_kernel") == "triton"
        assert backends.choose("fake_kernel") == "triton"
    assert len([r for r in caplog.records if "fake_kernel" in r.getMessage()]) == 1
    assert not backends.available("surely_not_an_installed_module_x")
    assert backends.decide("fake_kernel") == backends.Decision(
        "triton", "surely_not_an_installed_module_x not installed"
    )


def test_installed_library_without_adapter_still_uses_triton(monkeypatch) -> None:
    monkeypatch.setitem(backends.OPTIONAL, "fake_kernel2", "json")  # importable
    assert backends.available("json")
    assert backends.choose("fake_kernel2") == "triton"
    assert backends.decide("fake_kernel2").why == "no json adapter for fake_kernel2"


def test_a_tested_adapter_is_chosen_when_its_library_fits(monkeypatch) -> None:
    """FlashInfer's MLA decode adapter (tests/kernels/test_mla_decode_flashinfer.py on a GPU)
    and DeepGEMM's FP8 grouped GEMM adapter (tests/kernels/test_moe_gemm_deepgemm.py) are
    picked wherever their library is installed as a build that fits this torch."""
    monkeypatch.setattr(backends, "available", lambda module: True)
    monkeypatch.setattr(
        backends, "library_status", lambda module: _status(module, True, f"{module} 1, fits")
    )
    assert backends.decide("mla_decode") == backends.Decision("flashinfer", "flashinfer 1, fits")
    assert backends.choose("moe_fp8_gemm") == "deep_gemm"
    assert backends.choose("mla_prefill") == "triton"


def test_a_mismatched_build_falls_back_to_triton_with_a_warning(caplog, monkeypatch) -> None:
    refusal = (
        "sgl-deep-gemm 0.1.7 is built for torch 2.13 + CUDA 13, this is torch 2.11.0+cu130 "
        "(CUDA 13.0): pip install sgl-deep-gemm==0.1.5 (or bash scripts/setup-gpu.sh)"
    )
    monkeypatch.setattr(backends, "available", lambda module: True)
    monkeypatch.setattr(backends, "library_status", lambda module: _status(module, False, refusal))
    with caplog.at_level(logging.INFO, logger="dsmesh.kernels.backends"):
        assert backends.decide("moe_fp8_gemm") == backends.Decision("triton", refusal)
    (warning,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert warning.getMessage() == f"moe_fp8_gemm: {refusal}; using dsmesh's Triton kernel"
