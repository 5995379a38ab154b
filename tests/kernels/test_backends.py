"""Optional backends are looked up lazily and fall back to the Triton kernels."""

from __future__ import annotations

import logging

from dsmesh.kernels import backends


def test_missing_library_means_triton_and_is_logged_once(caplog, monkeypatch) -> None:
    backends.choose.cache_clear()
    monkeypatch.setitem(backends.OPTIONAL, "fake_kernel", "surely_not_an_installed_module_x")
    with caplog.at_level(logging.INFO, logger="dsmesh.kernels.backends"):
        assert backends.choose("fake_kernel") == "triton"
        assert backends.choose("fake_kernel") == "triton"
    assert len([r for r in caplog.records if "fake_kernel" in r.getMessage()]) == 1
    assert not backends.available("surely_not_an_installed_module_x")


def test_installed_library_without_adapter_still_uses_triton(monkeypatch) -> None:
    backends.choose.cache_clear()
    monkeypatch.setitem(backends.OPTIONAL, "fake_kernel2", "json")  # importable
    assert backends.available("json")
    assert backends.choose("fake_kernel2") == "triton"
    backends.choose.cache_clear()


def test_a_tested_adapter_is_chosen_when_its_library_is_installed(monkeypatch) -> None:
    """FlashInfer's MLA decode adapter (tests/kernels/test_mla_decode_flashinfer.py on a GPU)
    and DeepGEMM's FP8 grouped GEMM adapter (tests/kernels/test_moe_gemm_deepgemm.py) are
    picked wherever their library is importable."""
    backends.choose.cache_clear()
    monkeypatch.setattr(backends, "available", lambda module: True)
    assert backends.choose("mla_decode") == "flashinfer"
    assert backends.choose("moe_fp8_gemm") == "deep_gemm"
    assert backends.choose("mla_prefill") == "triton"
    backends.choose.cache_clear()
