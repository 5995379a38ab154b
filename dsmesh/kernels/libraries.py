"""Which builds of the optional GPU libraries fit which torch: FlashInfer, DeepGEMM, DeepEP.

FlashInfer compiles its kernels on the machine (JIT), so one wheel fits any CUDA torch;
dsmesh's MLA decode adapter was tested with one release (:data:`FLASHINFER_TESTED`).
DeepGEMM (SGLang's ``sgl-deep-gemm``) and DeepEP (``sgl-deep-ep``) ship a host library compiled
against one torch and CUDA 13: a release built for another torch imports and then misreads
tensors or fails to load (docs/KERNELS.md). :data:`DEEP_GEMM_BUILDS` and
:data:`DEEP_EP_BUILDS` record which torch each release was built for (docs/GPU.md, "Install",
says how that was read from the wheels) and which release the installer picks.

Everything here is a pure function of version strings, except :func:`find_installed` and
:func:`status`, which read the installed distributions' metadata (never importing the
libraries) and torch's versions. Imports only the standard library, so
``scripts/setup-gpu.sh`` can use it before dsmesh is installed.
"""

from __future__ import annotations

import functools
import importlib.util
import re
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import metadata

__all__ = [
    "DEEP_EP_BUILDS",
    "DEEP_GEMM_BUILDS",
    "FLASHINFER_DIST",
    "FLASHINFER_TESTED",
    "SETUP_HINT",
    "BinaryBuild",
    "Installed",
    "LibraryStatus",
    "build_for",
    "check",
    "find_installed",
    "status",
    "torch_release",
]

SETUP_HINT = "bash scripts/setup-gpu.sh"
FLASHINFER_DIST = "flashinfer-python"
FLASHINFER_TESTED = "0.6.18.post1"  # with torch 2.11 + CUDA 13.0 on the H200, 2026-11-29


@dataclass(frozen=True)
class BinaryBuild:
    """Releases ``versions`` of ``distribution`` whose host library was compiled against torch
    ``torch`` and CUDA ``cuda_major``. ``torch`` is a release prefix: "2.11" fits every 2.11.x,
    "2.13.0" only 2.13.0 (the wheel pins ``torch==2.13.0``). ``install`` is the release the
    installer picks for that torch; ``tested``: dsmesh's GPU tests ran that release."""

    distribution: str
    versions: tuple[str, ...]
    torch: str
    cuda_major: int
    install: str
    tested: bool

    def fits(self, torch_version: str, cuda_version: str | None) -> bool:
        """Whether this build's library can run under ``torch_version`` / ``cuda_version``."""
        return _release_matches(torch_version, self.torch) and _cuda_major(cuda_version) == (
            self.cuda_major
        )


# sgl-deep-gemm pins no torch in its metadata; the torch of each release was read from its
# _C.so (the torch symbols it needs, and the torch header lines its asserts name), 2026-12-04.
DEEP_GEMM_BUILDS = (
    BinaryBuild(
        "sgl-deep-gemm",
        ("0.0.1", "0.1.0", "0.1.1", "0.1.2", "0.1.3", "0.1.4", "0.1.4.post1", "0.1.5",
         "0.1.5.post1"),
        torch="2.11", cuda_major=13, install="0.1.5", tested=True,
    ),
    BinaryBuild(
        "sgl-deep-gemm",
        ("0.1.5.post2", "0.1.5.post3", "0.1.6", "0.1.7", "0.2.0", "0.2.1"),
        torch="2.13", cuda_major=13, install="0.2.1", tested=False,
    ),
    BinaryBuild(
        "sgl-deep-gemm",
        ("0.2.1.post1", "0.2.2", "0.2.3", "0.2.3.post1", "0.2.3.post2", "0.2.5"),
        torch="2.14", cuda_major=13, install="0.2.5", tested=False,
    ),
)  # fmt: skip

# sgl-deep-ep pins torch exactly (Requires-Dist), CUDA 13 (its _build_info), CPython 3.10-3.13.
DEEP_EP_BUILDS = (
    BinaryBuild(
        "sgl-deep-ep", ("0.1.0", "0.1.1", "0.1.2"),
        torch="2.13.0", cuda_major=13, install="0.1.2", tested=False,
    ),
    BinaryBuild(
        "sgl-deep-ep", ("0.1.2.post1",),
        torch="2.14.1", cuda_major=13, install="0.1.2.post1", tested=False,
    ),
)  # fmt: skip
DEEP_EP_PYTHONS = ((3, 10), (3, 13))  # the CPython versions sgl-deep-ep publishes wheels for

# module -> (distributions known to provide it; the binary builds, if any)
_KNOWN = {
    "flashinfer": ((FLASHINFER_DIST,), ()),
    "deep_gemm": (("sgl-deep-gemm", "deep-gemm", "deep_gemm"), DEEP_GEMM_BUILDS),
    "deep_ep": (("sgl-deep-ep", "deepinfer-ep", "deep-ep", "deep_ep"), DEEP_EP_BUILDS),
}
# DeepEP V2 distributions: they dropped V1's ``deep_ep.Buffer``, which dsmesh's backend calls
_DEEP_EP_V2 = ("deepinfer-ep",)


@dataclass(frozen=True)
class Installed:
    """An installed distribution providing a module; ``distribution`` None when the module
    is importable but no package metadata names it."""

    distribution: str | None
    version: str | None

    def __str__(self) -> str:
        if self.distribution is None:
            return "an unpackaged copy (no package metadata)"
        return f"{self.distribution} {self.version}"


@dataclass(frozen=True)
class LibraryStatus:
    """Whether dsmesh may use ``module`` here. ``detail`` is one line for the log and the
    kernel summary: what is installed, and when an installed build cannot be used, why and
    what to install (``pip install X==Y`` or :data:`SETUP_HINT`). ``fix``: what to run for a
    build that fits this torch, or which torch the builds need (:func:`install_hint`)."""

    module: str
    installed: Installed | None
    usable: bool
    detail: str
    fix: str


def torch_release(version: str) -> tuple[int, ...]:
    """(major, minor, patch) of a torch version string: "2.11.0+cu130" -> (2, 11, 0);
    pre-release and local parts are dropped. Raises ValueError on anything else."""
    match = re.match(r"^\s*(\d+)\.(\d+)(?:\.(\d+))?", version)
    if match is None:
        raise ValueError(f"not a torch version: {version!r}")
    major, minor, patch = match.groups()
    return int(major), int(minor), int(patch or 0)


def _release_matches(torch_version: str, prefix: str) -> bool:
    want = tuple(int(p) for p in prefix.split("."))
    return torch_release(torch_version)[: len(want)] == want


def _cuda_major(cuda_version: str | None) -> int | None:
    if not cuda_version:
        return None
    return int(cuda_version.split(".")[0])


def _torch_label(torch_version: str, cuda_version: str | None) -> str:
    cuda = f"CUDA {cuda_version}" if cuda_version else "no CUDA"
    return f"torch {torch_version} ({cuda})"


def build_for(
    builds: tuple[BinaryBuild, ...], torch_version: str, cuda_version: str | None
) -> BinaryBuild | None:
    """The build among ``builds`` that fits this torch and CUDA, or None."""
    return next((b for b in builds if b.fits(torch_version, cuda_version)), None)


def builds_summary(builds: tuple[BinaryBuild, ...]) -> str:
    """E.g. "torch 2.11 (0.0.1-0.1.5.post1), torch 2.13 (0.1.5.post2-0.2.1), ...": for the
    line that says no build fits."""
    return ", ".join(f"torch {b.torch} + CUDA {b.cuda_major} ({_span(b.versions)})" for b in builds)


def _span(versions: tuple[str, ...]) -> str:
    return versions[0] if len(versions) == 1 else f"{versions[0]}-{versions[-1]}"


def install_hint(module: str, torch_version: str, cuda_version: str | None) -> str:
    """What to run so that ``module`` fits this torch: "pip install sgl-deep-gemm==0.1.5 (or
    bash scripts/setup-gpu.sh)", or, where no build fits, which torch the builds need."""
    if module == "flashinfer":
        return f"pip install {FLASHINFER_DIST}=={FLASHINFER_TESTED} (or {SETUP_HINT})"
    builds = _KNOWN[module][1]
    build = build_for(builds, torch_version, cuda_version)
    if build is not None:
        return f"pip install {build.distribution}=={build.install} (or {SETUP_HINT})"
    dist = builds[0].distribution
    return (
        f"no {dist} build fits {_torch_label(torch_version, cuda_version)}; builds exist for "
        f"{builds_summary(builds)}: pip uninstall {dist}, or build {module} from source "
        "against this torch"
    )


def check(
    module: str, installed: Installed | None, torch_version: str, cuda_version: str | None
) -> LibraryStatus:
    """Whether ``installed`` (what provides ``module``; None: not installed) may run with
    this torch. Usable: FlashInfer at the tested release; an ``sgl-deep-gemm`` /
    ``sgl-deep-ep`` release recorded as built for this torch and CUDA; a copy built from
    source (another distribution name, or no metadata), which was compiled against the torch
    it was installed with (DeepGEMM's load check still runs before first use). Not usable:
    anything else, with the version to install."""
    if module not in _KNOWN:
        raise ValueError(f"unknown optional library {module!r}; known: {sorted(_KNOWN)}")
    here = _torch_label(torch_version, cuda_version)
    hint = install_hint(module, torch_version, cuda_version)
    if installed is None:
        return LibraryStatus(module, None, False, f"{module} not installed", hint)
    if installed.distribution is None:
        return LibraryStatus(
            module, installed, True, f"{module}: {installed}, version unchecked", hint
        )
    if module == "flashinfer":
        if installed.version == FLASHINFER_TESTED:
            return LibraryStatus(module, installed, True, str(installed), hint)
        detail = (
            f"{installed} is not the release dsmesh's adapter was tested with "
            f"({FLASHINFER_TESTED}): {hint}"
        )
        return LibraryStatus(module, installed, False, detail, hint)
    if installed.distribution in _DEEP_EP_V2:
        detail = (
            f"{installed} is DeepEP V2, without the V1 deep_ep.Buffer API that dsmesh's "
            f"backend calls: pip uninstall {installed.distribution}; for DeepEP here: {hint}"
        )
        return LibraryStatus(module, installed, False, detail, hint)
    builds = [b for b in _KNOWN[module][1] if b.distribution == installed.distribution]
    if not builds:  # built from source here, against the torch it was installed with
        return LibraryStatus(module, installed, True, f"{installed} (built from source)", hint)
    build = next((b for b in builds if installed.version in b.versions), None)
    if build is None:
        detail = f"{installed} is not in dsmesh's table of builds (untested): {hint}"
        return LibraryStatus(module, installed, False, detail, hint)
    if not build.fits(torch_version, cuda_version):
        detail = (
            f"{installed} is built for torch {build.torch} + CUDA {build.cuda_major}, "
            f"this is {here}: {hint}"
        )
        return LibraryStatus(module, installed, False, detail, hint)
    note = "" if build.tested and installed.version == build.install else ", untested by dsmesh"
    detail = f"{installed}, built for torch {build.torch} + CUDA {build.cuda_major}{note}"
    return LibraryStatus(module, installed, True, detail, hint)


def find_installed(module: str) -> Installed | None:
    """What provides ``module`` here, from package metadata (the module is not imported);
    None when it cannot be imported at all."""
    if importlib.util.find_spec(module) is None:
        return None
    for dist in _distributions_of(module):
        try:
            return Installed(dist, metadata.version(dist))
        except metadata.PackageNotFoundError:
            continue
    return Installed(None, None)


def _distributions_of(module: str) -> Iterator[str]:
    """The distributions that may provide ``module``: its known ones, then (read only when
    none of those is installed) the ones the installed packages' file lists name, a scan of
    every installed distribution that takes 0.1 s or more (an engine's start-up)."""
    yield from _KNOWN.get(module, ((), ()))[0]
    yield from (d for d in metadata.packages_distributions().get(module, []) if d)


@functools.cache
def status(module: str) -> LibraryStatus:
    """:func:`check` for what is installed here and the torch this process runs."""
    import torch

    return check(module, find_installed(module), torch.__version__, torch.version.cuda)
