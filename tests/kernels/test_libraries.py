"""dsmesh/kernels/libraries.py: which FlashInfer / DeepGEMM / DeepEP builds fit which torch,
and the line a refused build gets (naming the release to install). Fake versions only: the
libraries are never imported, and their metadata is monkeypatched where it is read."""

from __future__ import annotations

from importlib import metadata

import pytest

from dsmesh.kernels import libraries as lib
from dsmesh.kernels.libraries import Installed, check

H200 = ("2.11.0+cu130", "13.0")  # the GPU machine's torch


def test_torch_release_parses_local_and_pre_release_parts() -> None:
    assert lib.torch_release("2.11.0+cu130") == (2, 11, 0)
    assert lib.torch_release("2.12.0a0+git3f2c1d") == (2, 12, 0)
    assert lib.torch_release("2.14") == (2, 14, 0)
    with pytest.raises(ValueError, match="not a torch version"):
        lib.torch_release("cu130")


def test_the_build_tables_are_consistent() -> None:
    """Every release sits in one build; the release picked is one of its build's."""
    for builds in (lib.DEEP_GEMM_BUILDS, lib.DEEP_EP_BUILDS):
        seen: set[str] = set()
        for build in builds:
            assert build.install in build.versions
            assert not seen & set(build.versions), build
            seen |= set(build.versions)
        assert len({b.torch for b in builds}) == len(builds)
    assert [b for b in lib.DEEP_GEMM_BUILDS if b.tested] == [lib.DEEP_GEMM_BUILDS[0]]


@pytest.mark.parametrize(
    ("torch_version", "cuda", "deep_gemm", "deep_ep"),
    [
        ("2.11.0+cu130", "13.0", "0.1.5", None),
        ("2.11.1", "13.0", "0.1.5", None),
        ("2.12.0+cu130", "13.0", None, None),
        ("2.13.0+cu130", "13.0", "0.2.1", "0.1.2"),
        ("2.13.1+cu130", "13.0", "0.2.1", None),  # sgl-deep-ep pins torch==2.13.0 exactly
        ("2.14.1+cu130", "13.0", "0.2.5", "0.1.2.post1"),
        ("2.14.0", "13.0", "0.2.5", None),
        ("2.11.0+cu128", "12.8", None, None),  # every build links CUDA 13
        ("2.11.0+cpu", None, None, None),
    ],
)
def test_build_for_each_torch(torch_version, cuda, deep_gemm, deep_ep) -> None:
    gemm = lib.build_for(lib.DEEP_GEMM_BUILDS, torch_version, cuda)
    ep = lib.build_for(lib.DEEP_EP_BUILDS, torch_version, cuda)
    assert (gemm.install if gemm else None) == deep_gemm
    assert (ep.install if ep else None) == deep_ep


def test_flashinfer_only_at_the_tested_release() -> None:
    ok = check("flashinfer", Installed("flashinfer-python", "0.6.18.post1"), *H200)
    assert ok.usable and ok.detail == "flashinfer-python 0.6.18.post1"
    newer = check("flashinfer", Installed("flashinfer-python", "0.7.4"), *H200)
    assert not newer.usable
    assert newer.detail == (
        "flashinfer-python 0.7.4 is not the release dsmesh's adapter was tested with "
        "(0.6.18.post1): pip install flashinfer-python==0.6.18.post1 (or bash "
        "scripts/setup-gpu.sh)"
    )
    missing = check("flashinfer", None, *H200)
    assert not missing.usable and missing.detail == "flashinfer not installed"
    assert (
        missing.fix == "pip install flashinfer-python==0.6.18.post1 (or bash scripts/setup-gpu.sh)"
    )


def test_deep_gemm_built_for_the_installed_torch() -> None:
    ok = check("deep_gemm", Installed("sgl-deep-gemm", "0.1.5"), *H200)
    assert ok.usable
    assert ok.detail == "sgl-deep-gemm 0.1.5, built for torch 2.11 + CUDA 13"
    older = check("deep_gemm", Installed("sgl-deep-gemm", "0.1.3"), *H200)
    assert older.usable and older.detail.endswith(", untested by dsmesh")
    untested = check("deep_gemm", Installed("sgl-deep-gemm", "0.2.1"), "2.13.0+cu130", "13.0")
    assert untested.usable and "untested by dsmesh" in untested.detail


def test_deep_gemm_built_for_another_torch_names_the_release_to_install() -> None:
    wrong = check("deep_gemm", Installed("sgl-deep-gemm", "0.1.7"), *H200)
    assert not wrong.usable
    assert wrong.detail == (
        "sgl-deep-gemm 0.1.7 is built for torch 2.13 + CUDA 13, this is torch 2.11.0+cu130 "
        "(CUDA 13.0): pip install sgl-deep-gemm==0.1.5 (or bash scripts/setup-gpu.sh)"
    )
    other_way = check("deep_gemm", Installed("sgl-deep-gemm", "0.1.5"), "2.13.0+cu130", "13.0")
    assert not other_way.usable
    assert other_way.detail.endswith(
        "pip install sgl-deep-gemm==0.2.1 (or bash scripts/setup-gpu.sh)"
    )
    cuda12 = check("deep_gemm", Installed("sgl-deep-gemm", "0.1.5"), "2.11.0+cu128", "12.8")
    assert not cuda12.usable
    assert "no sgl-deep-gemm build fits torch 2.11.0+cu128 (CUDA 12.8)" in cuda12.detail
    assert "torch 2.11 + CUDA 13 (0.0.1-0.1.5.post1)" in cuda12.detail
    unknown = check("deep_gemm", Installed("sgl-deep-gemm", "0.3.0"), *H200)
    assert not unknown.usable
    assert unknown.detail == (
        "sgl-deep-gemm 0.3.0 is not in dsmesh's table of builds (untested): "
        "pip install sgl-deep-gemm==0.1.5 (or bash scripts/setup-gpu.sh)"
    )


def test_source_builds_and_unpackaged_copies_are_trusted() -> None:
    """A DeepGEMM or DeepEP compiled here (deploy/Dockerfile's fallback) was built against
    this torch; DeepGEMM's load check still runs before its first use."""
    src = check("deep_gemm", Installed("deep_gemm", "2.1.1"), "2.7.1+cu128", "12.8")
    assert src.usable and src.detail == "deep_gemm 2.1.1 (built from source)"
    ep = check("deep_ep", Installed("deep_ep", "1.2.1"), "2.7.1+cu128", "12.8")
    assert ep.usable
    bare = check("flashinfer", Installed(None, None), *H200)
    assert bare.usable and "version unchecked" in bare.detail


def test_deep_ep_needs_the_exact_torch_its_wheel_pins() -> None:
    none_fits = check("deep_ep", Installed("sgl-deep-ep", "0.1.2"), *H200)
    assert not none_fits.usable
    assert none_fits.detail.startswith(
        "sgl-deep-ep 0.1.2 is built for torch 2.13.0 + CUDA 13, this is torch 2.11.0+cu130"
    )
    assert "builds exist for torch 2.13.0 + CUDA 13 (0.1.0-0.1.2), torch 2.14.1 + CUDA 13 " in (
        none_fits.detail
    )
    assert none_fits.detail.endswith(
        "pip uninstall sgl-deep-ep, or build deep_ep from source against this torch"
    )
    ok = check("deep_ep", Installed("sgl-deep-ep", "0.1.2"), "2.13.0+cu130", "13.0")
    assert ok.usable
    swap = check("deep_ep", Installed("sgl-deep-ep", "0.1.2.post1"), "2.13.0+cu130", "13.0")
    assert not swap.usable
    assert swap.detail.endswith("pip install sgl-deep-ep==0.1.2 (or bash scripts/setup-gpu.sh)")


def test_deep_ep_v2_is_refused_whatever_the_torch() -> None:
    v2 = check("deep_ep", Installed("deepinfer-ep", "2.5.0"), "2.13.0+cu130", "13.0")
    assert not v2.usable
    assert v2.detail.startswith(
        "deepinfer-ep 2.5.0 is DeepEP V2, without the V1 deep_ep.Buffer API"
    )
    assert v2.detail.endswith("pip install sgl-deep-ep==0.1.2 (or bash scripts/setup-gpu.sh)")


def test_unknown_library_is_an_error() -> None:
    with pytest.raises(ValueError, match="unknown optional library 'flash_mla'"):
        check("flash_mla", None, *H200)


def test_find_installed_reads_package_metadata(monkeypatch) -> None:
    """The distribution providing a module is found from metadata, never by importing it, and
    the scan of every installed distribution only when no known one provides it."""
    versions = {"sgl-deep-gemm": "0.1.7"}

    def version(dist: str) -> str:
        if dist not in versions:
            raise metadata.PackageNotFoundError(dist)
        return versions[dist]

    monkeypatch.setattr(lib.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(lib.metadata, "version", version)

    def no_scan() -> dict[str, list[str]]:
        raise AssertionError("every installed distribution scanned for a known one")

    monkeypatch.setattr(lib.metadata, "packages_distributions", no_scan)
    assert lib.find_installed("deep_gemm") == Installed("sgl-deep-gemm", "0.1.7")
    monkeypatch.setattr(lib.metadata, "packages_distributions", lambda: {})
    assert lib.find_installed("deep_ep") == Installed(None, None)  # importable, no metadata
    monkeypatch.setattr(lib.metadata, "packages_distributions", lambda: {"deep_ep": ["my-ep"]})
    versions["my-ep"] = "1.0"
    assert lib.find_installed("deep_ep") == Installed("my-ep", "1.0")
    monkeypatch.setattr(lib.importlib.util, "find_spec", lambda name: None)
    assert lib.find_installed("deep_gemm") is None


def test_status_checks_this_torch(monkeypatch) -> None:
    import torch

    monkeypatch.setattr(lib, "find_installed", lambda m: Installed("sgl-deep-gemm", "0.1.7"))
    monkeypatch.setattr(torch, "__version__", "2.11.0+cu130")
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    lib.status.cache_clear()
    try:
        st = lib.status("deep_gemm")
    finally:
        lib.status.cache_clear()
    assert not st.usable and "pip install sgl-deep-gemm==0.1.5" in st.detail
