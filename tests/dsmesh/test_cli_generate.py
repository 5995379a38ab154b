"""`dsmesh generate` and `dsmesh make-tiny-model` as a user runs them (real subprocesses)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dsmesh.engine.llm_engine import EngineConfig, LLMEngine
from dsmesh.engine.sampling.params import SamplingParams
from dsmesh.engine.tokenizer import Tokenizer


def dsmesh(*args: str, cache: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, DSMESH_CACHE_DIR=str(cache))
    return subprocess.run(
        [sys.executable, "-m", "dsmesh", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")


def test_generate_json_matches_engine_in_input_order(cache: Path) -> None:
    proc = dsmesh(
        "generate",
        "--input-ids",
        "5,6,7",
        "--prompt",
        "Hello there",
        "--input-ids",
        "42",
        "--max-new-tokens",
        "8",
        "--ignore-eos",
        "--json",
        cache=cache,
    )
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(lines) == 3

    # The same run in-process, on the default model the CLI just built in the cache.
    os.environ["DSMESH_CACHE_DIR"] = str(cache)
    try:
        engine = LLMEngine(EngineConfig())
        from dsmesh.engine.model.tiny_model import default_model_dir

        tok = Tokenizer.from_dir(default_model_dir())
    finally:
        del os.environ["DSMESH_CACHE_DIR"]
    prompts = [[5, 6, 7], tok.encode("Hello there"), [42]]
    assert prompts[1][0] == tok.bos_token_id
    expected = engine.generate(prompts, SamplingParams(max_new_tokens=8, ignore_eos=True))
    for line, res, prompt in zip(lines, expected, prompts, strict=True):
        assert line["output_ids"] == res.output_ids
        assert len(line["output_ids"]) == 8
        assert line["text"] == tok.decode(res.output_ids, skip_special_tokens=True)
        assert line["prompt_tokens"] == len(prompt)
        assert line["finish_reason"] == "length"


def test_generate_plain_text_output(cache: Path) -> None:
    proc = dsmesh("generate", "--prompt", "abc", "--max-new-tokens", "4", cache=cache)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("--- [")
    assert "tok/s" in proc.stderr


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--input-ids", "1,2,999999"], "input_ids"),
        (["--input-ids", "1,x"], "--input-ids"),
        (["--prompt", "hi", "--temperature", "-1"], "temperature"),
        ([], "--prompt"),
    ],
)
def test_generate_bad_input_is_a_clear_error(cache: Path, args: list[str], needle: str) -> None:
    proc = dsmesh("generate", *args, cache=cache)
    assert proc.returncode == 2
    assert needle in proc.stderr
    assert "Traceback" not in proc.stderr


def test_make_tiny_model_and_generate_from_it(tmp_path: Path, cache: Path) -> None:
    out = tmp_path / "v2"
    proc = dsmesh("make-tiny-model", str(out), "--arch", "v2-lite", cache=cache)
    assert proc.returncode == 0, proc.stderr
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "deepseek_v2" and cfg["q_lora_rank"] is None
    proc = dsmesh(
        "generate",
        "--model",
        str(out),
        "--input-ids",
        "1,2,3",
        "--max-new-tokens",
        "5",
        "--ignore-eos",
        "--json",
        cache=cache,
    )
    assert proc.returncode == 0, proc.stderr
    assert len(json.loads(proc.stdout)["output_ids"]) == 5


def test_cli_arch_choices_match_engine() -> None:
    from dsmesh.cli.tiny import ARCHES
    from dsmesh.engine.model.tiny_model import TINY_ARCHES

    assert ARCHES == TINY_ARCHES
