"""Safetensors read through reused staging buffers (dsmesh/engine/model/staged_read.py): byte
for byte what safetensors' own loader returns, whatever the chunk size, with tensors skipped;
on a GPU, a model loaded through it equals the one loaded through the memory map."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from dsmesh.engine.model.staged_read import plan_chunks, read_header, read_staged


def _write(path, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tensors = {
        "a.odd_bytes": torch.randint(0, 255, (7,), generator=gen, dtype=torch.uint8),
        "b.bf16": torch.randn(33, 17, generator=gen).to(torch.bfloat16),  # after 7 bytes
        "c.fp8": torch.randn(5, 3, generator=gen).to(torch.float8_e4m3fn),
        "d.f32": torch.randn(100, 41, generator=gen),
        "e.i64": torch.arange(13, dtype=torch.int64) * (seed + 1),
        "f.big": torch.randn(4096, generator=gen),  # 16 KiB: larger than the small chunks
        "g.empty": torch.empty(0, 4),
    }
    save_file(tensors, str(path))
    return tensors


@pytest.fixture
def files(tmp_path):
    paths = [tmp_path / "one.safetensors", tmp_path / "two.safetensors"]
    for i, path in enumerate(paths):
        _write(path, seed=i)
    return paths


def _bytes_equal(got: torch.Tensor, want: torch.Tensor) -> bool:
    if got.dtype != want.dtype or got.shape != want.shape:
        return False
    return got.contiguous().view(torch.uint8).equal(want.contiguous().view(torch.uint8))


@pytest.mark.parametrize("readers", [1, 3])
@pytest.mark.parametrize("chunk_bytes", [1, 64, 1000, 5000, 1 << 20])
def test_every_tensor_equals_safetensors_load(files, chunk_bytes: int, readers: int) -> None:
    want = {}
    for path in files:
        want.update({f"{path.stem}/{k}": v for k, v in load_file(str(path)).items()})
    got = {}
    for path in files:
        for name, tensor in read_staged([path], "cpu", chunk_bytes=chunk_bytes, readers=readers):
            assert tensor.device.type == "cpu"
            got[f"{path.stem}/{name}"] = tensor
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert _bytes_equal(got[name], tensor), name


def test_only_the_names_asked_for_are_read_in_file_order(files) -> None:
    wanted = {"a.odd_bytes", "d.f32", "f.big"}  # gaps between them: separate runs
    order = [e.name for e in read_header(files[1]) if e.name in wanted]
    got = list(read_staged(files, "cpu", names=wanted, chunk_bytes=4096))
    assert [name for name, _ in got] == order * 2  # file by file, each in file order
    second = load_file(str(files[1]))
    for name, tensor in got[len(order) :]:
        assert _bytes_equal(tensor, second[name]), name


def test_runs_join_adjacent_tensors_up_to_the_chunk() -> None:
    entries = read_header_of_layout([("x", 0, 10), ("y", 10, 30), ("z", 30, 100), ("w", 120, 130)])
    runs = plan_chunks(entries, chunk_bytes=40)
    assert [[e.name for e in run] for run in runs] == [["x", "y"], ["z"], ["w"]]
    # one run when everything fits and touches; a gap always splits
    assert [[e.name for e in r] for r in plan_chunks(entries, 1000)] == [["x", "y", "z"], ["w"]]


def read_header_of_layout(spans: list[tuple[str, int, int]]):
    from dsmesh.engine.model.staged_read import TensorEntry

    return [
        TensorEntry(name, torch.uint8, (end - start,), start, end) for name, start, end in spans
    ]


def test_a_tensor_at_an_unaligned_offset_is_copied_before_its_view() -> None:
    from dsmesh.engine.model.staged_read import TensorEntry, _as_tensor

    value = torch.tensor([1.5, -2.25], dtype=torch.bfloat16)
    raw = torch.cat([torch.tensor([7], dtype=torch.uint8), value.view(torch.uint8)])
    entry = TensorEntry("x", torch.bfloat16, (2,), 1, 5)
    assert _bytes_equal(_as_tensor(raw[1:], entry), value)


def test_a_truncated_file_is_refused_naming_it(tmp_path) -> None:
    path = tmp_path / "cut.safetensors"
    _write(path, seed=3)
    data = path.read_bytes()
    path.write_bytes(data[:-100])
    with pytest.raises(ValueError, match="cut.safetensors: file ends at byte"):
        list(read_staged([path], "cpu"))


def _state(model) -> dict[str, torch.Tensor]:
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


@pytest.mark.parametrize("case", ["v3", "v3-fp8-experts", "v3-ep-rank-1-of-2"])
def test_weights_loaded_staged_equal_the_memory_mapped_load(
    case: str, v3_ckpt, tmp_path_factory
) -> None:
    """The loader's staged path (what CUDA takes) against its memory-map path, on the CPU:
    every parameter and buffer byte for byte, with FP8 experts (read through the memory
    map, the rest staged) and with an expert-parallel rank's share of the experts."""
    from dsmesh.bench.checkpoint import write_random_checkpoint
    from dsmesh.engine.ep.placement import round_robin_placement
    from dsmesh.engine.model.build import build_model
    from dsmesh.engine.model.config import load_config
    from dsmesh.engine.model.weights import load_weights

    path = v3_ckpt.path
    if case == "v3-fp8-experts":
        path = write_random_checkpoint("tiny-v3", tmp_path_factory.mktemp("fp8"), device="cpu")
    cfg = load_config(path)
    kwargs = {}
    if case == "v3-ep-rank-1-of-2":
        n = cfg.moe.n_routed_experts
        kwargs = {"expert_location": round_robin_placement(len(cfg.moe_layer_ids), n, 2, 2)}
        kwargs["ep_rank"] = 1
    keep_fp8 = case == "v3-fp8-experts"
    models = []
    for staged in (False, True):
        model = build_model(cfg, torch.float32, "cpu", **kwargs)
        load_weights(model, path, keep_fp8=keep_fp8, staged=staged)
        models.append(model)
    mapped, staged = (_state(m) for m in models)
    assert sorted(mapped) == sorted(staged)
    for name, tensor in mapped.items():
        assert _bytes_equal(staged[name], tensor), name
    assert sorted(models[0].fp8_weights) == sorted(models[1].fp8_weights)
    if keep_fp8:
        assert models[1].fp8_weights  # the FP8 experts took the memory-map path


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.gpu
@pytest.mark.parametrize("chunk_bytes", [4096, 1 << 27])
def test_cuda_staging_equals_safetensors_load(files, chunk_bytes: int) -> None:
    for path in files:
        want = load_file(str(path))
        got = dict(read_staged([path], "cuda", chunk_bytes=chunk_bytes))
        assert sorted(got) == sorted(want)
        for name, tensor in got.items():
            assert tensor.is_cuda
            assert _bytes_equal(tensor.cpu(), want[name]), name


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.gpu
def test_weights_loaded_staged_on_cuda_equal_the_memory_mapped_load(v2_greedy_ckpt) -> None:
    """The loader on CUDA, through pinned buffers (its default there) and through the
    memory map: every parameter and buffer byte for byte."""
    from dsmesh.engine.model.build import build_model
    from dsmesh.engine.model.config import load_config
    from dsmesh.engine.model.weights import load_weights

    cfg = load_config(v2_greedy_ckpt.path)
    states = []
    for staged in (None, False):  # None: CUDA's default, staged
        model = build_model(cfg, torch.bfloat16, "cuda")
        load_weights(model, v2_greedy_ckpt.path, staged=staged)
        states.append({k: v.cpu() for k, v in _state(model).items()})
    assert sorted(states[0]) == sorted(states[1])
    for name, tensor in states[1].items():
        assert _bytes_equal(states[0][name], tensor), name
