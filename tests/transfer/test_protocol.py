"""The transfer protocol choice: which protocol a pool gets, and the clear refusals."""

from __future__ import annotations

from pathlib import Path

import pytest

from dsmesh.runtime.transfer.protocol import (
    cuda_build_problem,
    is_loopback,
    rdma_devices,
    resolve_protocol,
)


@pytest.mark.parametrize(
    ("requested", "on_gpu", "host", "hcas", "expected"),
    [
        ("auto", False, "127.0.0.1", [], "tcp"),
        ("auto", False, "10.0.0.5", ["mlx5_0"], "tcp"),
        ("auto", True, "127.0.0.1", [], "nvlink_intra"),
        ("auto", True, "localhost", ["mlx5_0"], "nvlink_intra"),
        ("auto", True, "::1", [], "nvlink_intra"),
        ("auto", True, "10.0.0.5", ["mlx5_0"], "rdma"),
        ("tcp", False, "10.0.0.5", [], "tcp"),
        ("nvlink_intra", True, "10.0.0.5", [], "nvlink_intra"),
        ("rdma", False, "10.0.0.5", ["mlx5_0"], "rdma"),
        ("rdma", True, "127.0.0.1", ["mlx5_0", "mlx5_1"], "rdma"),
    ],
)
def test_resolve_protocol(requested, on_gpu, host, hcas, expected) -> None:
    assert resolve_protocol(requested, on_gpu, host, hcas) == expected


def test_tcp_refuses_a_gpu_pool_and_names_the_alternatives() -> None:
    with pytest.raises(ValueError, match="tcp cannot move a GPU KV pool") as info:
        resolve_protocol("tcp", True, "127.0.0.1", [])
    assert "nvlink_intra" in str(info.value) and "rdma" in str(info.value)


def test_auto_on_gpu_across_hosts_without_an_hca_is_refused() -> None:
    with pytest.raises(ValueError, match="no RDMA device") as info:
        resolve_protocol("auto", True, "10.0.0.5", [])
    assert "--transfer-protocol rdma" in str(info.value)


def test_rdma_without_an_hca_fails_clearly() -> None:
    with pytest.raises(ValueError, match=r"--transfer-protocol rdma: this host has no RDMA"):
        resolve_protocol("rdma", True, "10.0.0.5", [])


def test_rdma_device_that_is_not_there() -> None:
    with pytest.raises(ValueError, match="no RDMA device mlx5_9 here"):
        resolve_protocol("rdma", True, "10.0.0.5", ["mlx5_0"], device_name="mlx5_0,mlx5_9")


def test_nvlink_intra_needs_a_gpu_pool() -> None:
    with pytest.raises(ValueError, match="needs the KV pool on a CUDA device"):
        resolve_protocol("nvlink_intra", False, "127.0.0.1", [])


def test_unknown_protocol() -> None:
    with pytest.raises(ValueError, match="--transfer-protocol must be one of"):
        resolve_protocol("nvlink", True, "127.0.0.1", [])


def test_rdma_devices_reads_sysfs(tmp_path: Path) -> None:
    assert rdma_devices(tmp_path / "missing") == []
    for name in ("mlx5_1", "mlx5_0"):
        (tmp_path / name).mkdir()
    assert rdma_devices(tmp_path) == ["mlx5_0", "mlx5_1"]


def test_is_loopback() -> None:
    assert is_loopback("127.0.0.2") and is_loopback("localhost") and is_loopback("::1")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3")
    assert not is_loopback("node-1.cluster")


def test_cuda_build_must_match_torch() -> None:
    cuda13 = {"mooncake-transfer-engine-cuda13": "0.3.14"}
    cpu = {"mooncake-transfer-engine-non-cuda": "0.3.13.post1"}
    assert cuda_build_problem(cuda13, "13.0", "nvlink_intra") is None
    assert cuda_build_problem(cpu, None, "tcp") is None
    assert cuda_build_problem(cpu, "13.0", "tcp") is None  # a host pool: any build
    problem = cuda_build_problem(cpu, "13.0", "nvlink_intra")
    assert problem is not None and "dsmesh[transfer-gpu]" in problem
    assert "mooncake-transfer-engine-non-cuda 0.3.13.post1" in problem
    problem = cuda_build_problem(cuda13, "12.8", "rdma")
    assert problem is not None and "dsmesh[transfer-gpu-cu12]" in problem
