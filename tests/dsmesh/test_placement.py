"""dsmesh/cli/placement.py: which GPUs each engine instance of ``dsmesh up`` gets (pure)."""

from __future__ import annotations

import pytest

from dsmesh.cli.placement import (
    EngineInstance,
    PlacementError,
    cuda_visible_devices,
    parse_gpu_list,
    place,
    visible_gpu_ids,
)


def instances(prefill: int, decode: int, unified: int = 0, ranks: int = 1):
    counts = (("prefill", prefill), ("decode", decode), ("unified", unified))
    return [EngineInstance(role, i, ranks) for role, n in counts for i in range(n)]


def gpus(n: int) -> tuple[str, ...]:
    return tuple(str(i) for i in range(n))


def test_one_gpu_is_shared_by_prefill_and_decode() -> None:
    p = place(gpus(1), instances(1, 1))
    assert p.gpu_ids == {"prefill-0": ("0",), "decode-0": ("0",)}
    assert p.processes_per_gpu == {"0": 2}
    assert p.mem_fraction("prefill-0", 0.85) == pytest.approx(0.425)
    assert p.mem_fraction("decode-0", 0.85) == pytest.approx(0.425)


def test_two_gpus_one_each() -> None:
    p = place(gpus(2), instances(1, 1))
    assert p.gpu_ids == {"prefill-0": ("0",), "decode-0": ("1",)}
    assert p.processes_per_gpu == {"0": 1, "1": 1}
    assert p.mem_fraction("decode-0", 0.85) == 0.85


def test_eight_gpus_ep2_instances_take_consecutive_gpus() -> None:
    p = place(gpus(8), instances(2, 2, ranks=2))
    assert p.gpu_ids == {
        "prefill-0": ("0", "1"),
        "prefill-1": ("2", "3"),
        "decode-0": ("4", "5"),
        "decode-1": ("6", "7"),
    }
    assert set(p.processes_per_gpu.values()) == {1}


def test_more_ranks_than_gpus_share_round_robin() -> None:
    # 3 GPUs, 4 ranks: the decode group wraps round to GPU 0
    p = place(gpus(3), instances(1, 1, ranks=2))
    assert p.gpu_ids == {"prefill-0": ("0", "1"), "decode-0": ("2", "0")}
    assert p.processes_per_gpu == {"0": 2, "1": 1, "2": 1}
    assert p.mem_fraction("decode-0", 0.8) == pytest.approx(0.4)  # its most shared GPU
    assert p.mem_fraction("prefill-0", 0.8) == pytest.approx(0.4)
    # 2 GPUs, two EP-2 instances: each has both GPUs, one rank on each
    p = place(gpus(2), instances(1, 1, ranks=2))
    assert p.gpu_ids == {"prefill-0": ("0", "1"), "decode-0": ("0", "1")}
    assert p.processes_per_gpu == {"0": 2, "1": 2}


def test_unified_instances_follow_the_pairs() -> None:
    p = place(gpus(4), instances(1, 1, unified=2))
    assert p.gpu_ids == {
        "prefill-0": ("0",),
        "decode-0": ("1",),
        "unified-0": ("2",),
        "unified-1": ("3",),
    }


def test_explicit_lists_and_defaults_take_the_other_gpus() -> None:
    lists = {"decode": parse_gpu_list("0")}
    p = place(gpus(2), instances(1, 1), lists)
    assert p.gpu_ids == {"prefill-0": ("1",), "decode-0": ("0",)}
    # both roles named, on one GPU out of four
    lists = {"prefill": parse_gpu_list("3"), "decode": parse_gpu_list("3")}
    p = place(gpus(4), instances(1, 1), lists)
    assert p.gpu_ids == {"prefill-0": ("3",), "decode-0": ("3",)}
    assert p.processes_per_gpu == {"0": 0, "1": 0, "2": 0, "3": 2}
    # an EP instance on two named GPUs; the default decode group finds none free and shares
    lists = {"prefill": parse_gpu_list("2+3")}
    p = place(gpus(4), instances(1, 1, ranks=2), lists)
    assert p.gpu_ids == {"prefill-0": ("2", "3"), "decode-0": ("0", "1")}
    lists = {"prefill": parse_gpu_list("0+1")}
    p = place(gpus(3), instances(1, 1, ranks=2), lists)
    assert p.gpu_ids["decode-0"] == ("0", "1")  # only GPU 2 free: walk round all of them


def test_ids_are_those_of_cuda_visible_devices() -> None:
    visible = visible_gpu_ids("4,5", device_count=2)
    assert visible == ("4", "5")
    p = place(visible, instances(1, 1), {"prefill": parse_gpu_list("5")})
    assert p.gpu_ids == {"prefill-0": ("5",), "decode-0": ("4",)}
    with pytest.raises(
        PlacementError, match=r"--prefill-gpus: GPU 0 is not visible \(visible: 4,5\)"
    ):
        place(visible, instances(1, 1), {"prefill": parse_gpu_list("0")})


def test_visible_gpu_ids() -> None:
    assert visible_gpu_ids(None, 3) == ("0", "1", "2")
    assert visible_gpu_ids(None, 0) == ()
    assert visible_gpu_ids("", 2) == ()
    assert visible_gpu_ids(" 2, 3 ", 2) == ("2", "3")
    assert visible_gpu_ids("1,-1,2", 3) == ("1",)  # CUDA stops at an invalid entry
    assert visible_gpu_ids("0,1,2,3", 2) == ("0", "1")  # more listed than exist
    uuid = "GPU-8f6c0a56-1f3e-4c1b-9d2a-0c1e2f3a4b5c"
    assert visible_gpu_ids(uuid, 1) == (uuid,)


def test_parse_gpu_list() -> None:
    assert parse_gpu_list("0,1") == (("0",), ("1",))
    assert parse_gpu_list("0+1, 2+3") == (("0", "1"), ("2", "3"))
    for bad in ("", "0,", "0++1", "1+1"):
        with pytest.raises(ValueError):
            parse_gpu_list(bad)


def test_refusals_name_the_flag() -> None:
    with pytest.raises(
        PlacementError, match=r"--decode-gpus lists 2 instance\(s\) but --decode is 1"
    ):
        place(gpus(2), instances(1, 1), {"decode": parse_gpu_list("0,1")})
    with pytest.raises(PlacementError, match=r"--unified-gpus: GPU 2 is not visible"):
        place(gpus(2), instances(0, 0, unified=1), {"unified": parse_gpu_list("2")})
    with pytest.raises(PlacementError, match=r"--prefill-gpus: 0\+1 gives 2 GPU\(s\) to prefill-0"):
        place(gpus(2), instances(1, 1), {"prefill": parse_gpu_list("0+1")})
    with pytest.raises(PlacementError, match="no GPU is visible"):
        place((), instances(1, 1))


def test_an_ep_rank_never_shares_a_gpu_with_another_rank_of_its_instance() -> None:
    """NCCL refuses two ranks of one group on one GPU: one GPU per rank, or a clear error."""
    with pytest.raises(PlacementError, match=r"prefill-0 runs 2 ranks .* 1 GPU\(s\) are visible"):
        place(gpus(1), instances(1, 1, ranks=2))
    with pytest.raises(PlacementError, match=r"--decode-gpus: 0 gives 1 GPU\(s\) to decode-0"):
        place(gpus(2), instances(1, 1, ranks=2), {"decode": parse_gpu_list("0")})
    for n in range(2, 9):
        for p in (place(gpus(n), instances(3, 2, ranks=2)), place(gpus(n), instances(1, 4))):
            assert all(len(set(ids)) == len(ids) for ids in p.gpu_ids.values())
            counts = list(p.processes_per_gpu.values())
            assert max(counts) - min(counts) <= 1  # spread evenly


def test_an_instance_sees_its_gpus_first_then_the_others() -> None:
    assert cuda_visible_devices(("1",), gpus(2)) == "1,0"
    assert cuda_visible_devices(("2", "3"), gpus(4)) == "2,3,0,1"
    assert cuda_visible_devices(("5",), ("4", "5")) == "5,4"
    assert cuda_visible_devices(("0",), gpus(1)) == "0"
