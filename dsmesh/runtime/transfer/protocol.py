"""Which transfer-engine protocol moves a process's KV pool: a pure choice made at start-up.

- ``tcp``: host memory over TCP (a laptop, CI). Refused for a GPU pool: Mooncake's TCP
  transport stages GPU memory through 64 KiB host buffers with synchronous copies on one
  I/O thread (about 0.6-1.4 GB/s measured on an H200 host), which cannot keep up with
  prefill.
- ``nvlink_intra``: CUDA IPC between processes of one host (same GPU or NVLink peers);
  copies run on the GPU's copy engines.
- ``rdma``: GPUDirect RDMA (or host memory) across hosts; needs an RDMA NIC (HCA).
- ``auto``: ``tcp`` for a host pool; for a GPU pool ``nvlink_intra`` when this process is
  reached on a loopback address (every peer is on this host, as under ``dsmesh up``), else
  ``rdma`` when the host has an HCA. Anything else is refused with the flags to give.

The chosen protocol is part of the KV layout signature that kv_broker compares at the
handshake, so a prefill and a decode that cannot talk to each other fail there, clearly.
"""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path

PROTOCOLS = ("auto", "tcp", "rdma", "nvlink_intra")
RDMA_SYSFS = Path("/sys/class/infiniband")


def rdma_devices(sysfs: Path = RDMA_SYSFS) -> list[str]:
    """The RDMA devices (HCAs) of this host, e.g. ``["mlx5_0"]``; empty without any."""
    try:
        return sorted(p.name for p in sysfs.iterdir())
    except OSError:
        return []


def is_loopback(hostname: str) -> bool:
    if hostname == "localhost":
        return True
    try:
        return ipaddress.ip_address(hostname).is_loopback
    except ValueError:
        return False


def resolve_protocol(
    requested: str, pool_on_gpu: bool, hostname: str, hcas: list[str], device_name: str = ""
) -> str:
    """The protocol a process with this pool uses; ValueError naming the flag to change.

    ``requested`` is ``--transfer-protocol``; ``hostname`` the address peers reach this
    process at (``--transfer-hostname``); ``hcas`` the host's RDMA devices
    (:func:`rdma_devices`); ``device_name`` the RDMA devices asked for (``--transfer-device``).
    """
    if requested not in PROTOCOLS:
        raise ValueError(
            f"--transfer-protocol must be one of {', '.join(PROTOCOLS)}, got {requested!r}"
        )
    protocol = requested
    if requested == "auto":
        if not pool_on_gpu:
            return "tcp"
        if is_loopback(hostname):
            return "nvlink_intra"
        if hcas:
            protocol = "rdma"
        else:
            raise ValueError(
                f"the KV pool is on a GPU and peers reach this process at {hostname} (not "
                "loopback), so they may be on other hosts, but this host has no RDMA device "
                f"(nothing under {RDMA_SYSFS}): give --transfer-protocol rdma on hosts with "
                "RDMA NICs, or --transfer-protocol nvlink_intra when every prefill and "
                "decode runs on this host"
            )
    if protocol == "tcp" and pool_on_gpu:
        raise ValueError(
            "--transfer-protocol tcp cannot move a GPU KV pool at serving speed (Mooncake's "
            "TCP transport stages GPU memory through 64 KiB host buffers, about 1 GB/s): use "
            "nvlink_intra for peers on this host or rdma across hosts (or run on the CPU)"
        )
    if protocol == "nvlink_intra" and not pool_on_gpu:
        raise ValueError(
            "--transfer-protocol nvlink_intra needs the KV pool on a CUDA device (--device cuda)"
        )
    if protocol == "rdma":
        if not hcas:
            raise ValueError(
                f"--transfer-protocol rdma: this host has no RDMA device (nothing under "
                f"{RDMA_SYSFS}); GPUDirect RDMA needs an RDMA NIC and its driver "
                "(docs/DEPLOY.md), or use nvlink_intra for peers on this host"
            )
        wanted = [d for d in device_name.split(",") if d]
        missing = [d for d in wanted if d not in hcas]
        if missing:
            raise ValueError(
                f"--transfer-device {device_name}: no RDMA device {', '.join(missing)} here "
                f"(this host has {', '.join(hcas)})"
            )
    return protocol


def cuda_build_problem(
    installed: dict[str, str], torch_cuda: str | None, protocol: str
) -> str | None:
    """Why the installed Mooncake build cannot move a GPU pool under ``protocol``, or None.

    ``installed`` maps the Mooncake distributions present to their versions; ``torch_cuda``
    is ``torch.version.cuda`` (None on a CPU build of torch).
    """
    if protocol not in ("nvlink_intra", "rdma") or torch_cuda is None:
        return None
    if protocol == "rdma" and not installed:
        return None  # the import error says what to install
    major = torch_cuda.split(".")[0]
    wanted = "mooncake-transfer-engine-cuda13" if major == "13" else "mooncake-transfer-engine"
    extra = "transfer-gpu" if major == "13" else "transfer-gpu-cu12"
    builds = {
        "mooncake-transfer-engine-cuda13": "13",
        "mooncake-transfer-engine": "12",
        "mooncake-transfer-engine-non-cuda": None,
    }
    for name in installed:
        if builds.get(name, "?") == major:
            return None
    have = ", ".join(f"{n} {v}" for n, v in sorted(installed.items())) or "none"
    return (
        f"--transfer-protocol {protocol} with torch built for CUDA {torch_cuda} needs "
        f"{wanted} (pip install 'dsmesh[{extra}]'); installed Mooncake builds: {have}"
    )


def installed_mooncake_builds() -> dict[str, str]:
    """The Mooncake Transfer Engine distributions installed, with their versions."""
    from importlib import metadata

    out = {}
    for name in (
        "mooncake-transfer-engine",
        "mooncake-transfer-engine-cuda13",
        "mooncake-transfer-engine-non-cuda",
    ):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return out


def intranode_env() -> dict[str, str]:
    """Environment the engine reads at initialize to install its intra-node NVLink transport."""
    return {"MC_INTRANODE_NVLINK": os.environ.get("MC_INTRANODE_NVLINK", "1")}
