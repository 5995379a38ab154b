"""Where an installed FlashInfer or DeepEP is a build dsmesh must not use (another torch, an
untested release), ``auto`` keeps dsmesh's own path and an explicit request fails with the
release to install. The library checks are faked (dsmesh/kernels/libraries.py's statuses);
nothing is imported from the libraries, no GPU is needed."""

from __future__ import annotations

import pytest
import torch

from dsmesh.engine.ep import deepep
from dsmesh.engine.ep.runtime import EPConfig, check_dispatch
from dsmesh.engine.model import mla_decode_backend
from dsmesh.kernels import backends
from dsmesh.kernels import libraries as lib
from dsmesh.kernels.libraries import Installed, check

FLASHINFER_074 = check("flashinfer", Installed("flashinfer-python", "0.7.4"), "2.11.0", "13.0")
DEEP_EP_213 = check("deep_ep", Installed("sgl-deep-ep", "0.1.2"), "2.11.0+cu130", "13.0")
SHAPE = (4, 512, 64, 1.0)  # heads, kv_lora_rank, rope dim, scale


@pytest.fixture
def flashinfer_074(monkeypatch):
    """FlashInfer 0.7.4 installed (importable) under torch 2.11."""
    monkeypatch.setattr(backends, "available", lambda module: True)
    monkeypatch.setattr(mla_decode_backend, "available", lambda module: True)
    monkeypatch.setattr(backends, "library_status", lambda module: FLASHINFER_074)
    monkeypatch.setattr(mla_decode_backend, "library_status", lambda module: FLASHINFER_074)
    backends.decide.cache_clear()
    yield
    backends.decide.cache_clear()


def test_auto_keeps_triton_for_an_untested_flashinfer(flashinfer_074) -> None:
    cuda = torch.device("cuda")  # a device object only: nothing runs on it
    assert not mla_decode_backend.flashinfer_fits((512, 64), cuda, torch.bfloat16)
    assert backends.decide("mla_decode").why == FLASHINFER_074.detail


def test_explicit_flashinfer_fails_naming_the_release(flashinfer_074) -> None:
    with pytest.raises(ValueError) as err:
        mla_decode_backend.make_decode_backend(
            "flashinfer", "flashinfer", torch.device("cuda"), SHAPE, torch.bfloat16, 16, 64
        )
    assert str(err.value) == (
        "attention='flashinfer': flashinfer-python 0.7.4 is not the release dsmesh's adapter "
        "was tested with (0.6.18.post1): pip install flashinfer-python==0.6.18.post1 (or bash "
        "scripts/setup-gpu.sh)"
    )


def test_explicit_flashinfer_not_installed_names_the_release(monkeypatch) -> None:
    monkeypatch.setattr(mla_decode_backend, "available", lambda module: False)
    with pytest.raises(ValueError) as err:
        mla_decode_backend.make_decode_backend(
            "flashinfer", "flashinfer", torch.device("cuda"), SHAPE, torch.bfloat16, 16, 64
        )
    assert str(err.value) == (
        "attention='flashinfer' but FlashInfer is not installed "
        "(pip install flashinfer-python==0.6.18.post1, or bash scripts/setup-gpu.sh)"
    )


def test_deep_ep_for_another_torch_is_not_imported(monkeypatch) -> None:
    """``auto`` dispatch falls back to all-to-all with the reason; a forced DeepEP is
    refused before any rank starts, naming which torch the builds need."""
    monkeypatch.setattr(deepep.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(deepep, "library_status", lambda module: DEEP_EP_213)
    monkeypatch.setattr(lib, "status", lambda module: DEEP_EP_213)
    usable, why = deepep.deepep_available(torch.device("cuda"))
    assert not usable and why == DEEP_EP_213.detail
    assert "builds exist for torch 2.13.0 + CUDA 13 (0.1.0-0.1.2)" in why
    with pytest.raises(ValueError) as err:
        check_dispatch(EPConfig(ep_size=2, dispatch="deepep"))
    assert str(err.value) == f"moe_dispatch deepep: {DEEP_EP_213.detail}"
