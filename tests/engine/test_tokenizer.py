"""Tests for dsmesh.engine.tokenizer, with transformers' PreTrainedTokenizerFast as the
reference."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import jinja2
import pytest
from tokenizers import pre_tokenizers

from dsmesh.engine.tokenizer import (
    ASSISTANT_TOKEN,
    BOS_TOKEN,
    EOS_TOKEN,
    USER_TOKEN,
    IncrementalDetokenizer,
    Tokenizer,
    write_byte_level_tokenizer,
)

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "naïve café, déjà vu, Ærøskøbing, Straße",
    "日本語のテキストと中文字符",
    "emoji 🙂🚀👩‍👩‍👧 and flags 🇫🇷",
    "  leading spaces,\ttabs\nand newlines  ",
    f"text around special tokens {USER_TOKEN}hi{ASSISTANT_TOKEN}",
]

CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Hi there"},
    ],
    [
        {"role": "system", "content": "You are helpful."},
        {"role": "system", "content": "Use French."},
        {"role": "user", "content": "Bonjour, ça va ?"},
        {"role": "assistant", "content": "Très bien, merci ! 🙂"},
        {"role": "user", "content": "日本語は？"},
    ],
    [
        {"role": "user", "content": "one"},
        {"role": "assistant", "content": "two", "tool_calls": None},
    ],
]

MULTI_BYTE_TEXT = "Grüße aus Köln — 東京の天気は晴れ ☀️, emoji 🙂🚀 and more plain text."


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tok")
    write_byte_level_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def tok(checkpoint: Path) -> Tokenizer:
    return Tokenizer.from_dir(checkpoint)


@pytest.fixture(scope="module")
def hf_tok(checkpoint: Path) -> Any:
    transformers = pytest.importorskip("transformers")
    return transformers.PreTrainedTokenizerFast.from_pretrained(str(checkpoint))


# --- write_byte_level_tokenizer -----------------------------------------------------------------


def test_writer_is_deterministic(tmp_path: Path) -> None:
    sizes = [write_byte_level_tokenizer(tmp_path / name) for name in ("a", "b")]
    assert sizes == [512, 512]
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    assert (tmp_path / "a" / "tokenizer.json").stat().st_size < 64 * 1024


def test_writer_layout(checkpoint: Path, tok: Tokenizer) -> None:
    raw = json.loads((checkpoint / "tokenizer.json").read_text(encoding="utf-8"))
    vocab = raw["model"]["vocab"]
    by_id = sorted(vocab, key=vocab.__getitem__)
    assert by_id[:256] == sorted(pre_tokenizers.ByteLevel.alphabet())
    assert len(vocab) == 508 and len(raw["model"]["merges"]) == 252
    added = {t["content"]: (t["id"], t["special"]) for t in raw["added_tokens"]}
    assert added == {
        BOS_TOKEN: (508, True),
        EOS_TOKEN: (509, True),
        USER_TOKEN: (510, True),
        ASSISTANT_TOKEN: (511, True),
    }
    config = json.loads((checkpoint / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert config["bos_token"] == BOS_TOKEN and config["eos_token"] == EOS_TOKEN
    assert config["add_bos_token"] is True and config["add_eos_token"] is False
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert (tok.bos_token_id, tok.eos_token_id, tok.vocab_size) == (508, 509, 512)
    assert tok.chat_template == config["chat_template"]


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id and tok.eos_token_id not in ids
    assert tok.encode(text, add_special_tokens=False) == ids[1:]
    assert tok.decode(ids[1:]) == text
    assert tok.decode(ids) == BOS_TOKEN + text
    assert tok.decode(ids, skip_special_tokens=True) == text.replace(USER_TOKEN, "").replace(
        ASSISTANT_TOKEN, ""
    )


def test_merges_compress_english(tok: Tokenizer) -> None:
    text = "the quick brown fox"
    assert len(tok.encode(text, add_special_tokens=False)) < len(text.encode()) // 2


# --- transformers as the reference --------------------------------------------------------------


def test_auto_tokenizer_loads_same_folder(checkpoint: Path, tok: Tokenizer) -> None:
    transformers = pytest.importorskip("transformers")
    auto = transformers.AutoTokenizer.from_pretrained(str(checkpoint))
    for text in TEXTS:
        assert auto.encode(text) == tok.encode(text)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(tok: Tokenizer, hf_tok: Any, text: str) -> None:
    for add_special_tokens in (True, False):
        ids = tok.encode(text, add_special_tokens=add_special_tokens)
        assert ids == hf_tok.encode(text, add_special_tokens=add_special_tokens)
        for skip in (True, False):
            assert tok.decode(ids, skip) == hf_tok.decode(ids, skip_special_tokens=skip)
    assert (tok.bos_token_id, tok.eos_token_id) == (hf_tok.bos_token_id, hf_tok.eos_token_id)
    assert tok.vocab_size == len(hf_tok)


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(
    tok: Tokenizer, hf_tok: Any, conversation: list[dict[str, Any]], add_generation_prompt: bool
) -> None:
    text = tok.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt)
    expected = hf_tok.apply_chat_template(
        conversation, add_generation_prompt=add_generation_prompt, tokenize=False
    )
    assert text == expected
    ids = tok.apply_chat_template(
        conversation, add_generation_prompt=add_generation_prompt, tokenize=True
    )
    expected_ids = hf_tok.apply_chat_template(
        conversation, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
    )
    assert ids == expected_ids
    assert isinstance(ids, list) and ids.count(tok.bos_token_id) == 1 and ids[0] == 508


def test_chat_template_renders_deepseek_format(tok: Tokenizer) -> None:
    text = tok.apply_chat_template(CONVERSATIONS[2])
    assert text == (
        f"{BOS_TOKEN}You are helpful.\n\nUse French."
        f"{USER_TOKEN}Bonjour, ça va ?{ASSISTANT_TOKEN}Très bien, merci ! 🙂{EOS_TOKEN}"
        f"{USER_TOKEN}日本語は？{ASSISTANT_TOKEN}"
    )
    ids = tok.apply_chat_template(CONVERSATIONS[0], tokenize=True)
    assert isinstance(ids, list)
    assert ids[:2] == [508, 510] and ids[-1] == 511  # BOS, User ... Assistant
    with pytest.raises(jinja2.exceptions.TemplateError, match="unsupported role: tool"):
        tok.apply_chat_template([{"role": "tool", "content": "42"}])


def test_config_variants_match_transformers(checkpoint: Path, tmp_path: Path) -> None:
    """AddedToken-style dicts and a list of named templates load the same in both."""
    transformers = pytest.importorskip("transformers")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((checkpoint / name).read_bytes())
    config = json.loads((tmp_path / "tokenizer_config.json").read_text(encoding="utf-8"))
    for key in ("bos_token", "eos_token"):
        config[key] = {
            "__type": "AddedToken",
            "content": config[key],
            "lstrip": False,
            "normalized": True,
            "rstrip": False,
            "single_word": False,
        }
    config["chat_template"] = [
        {"name": "default", "template": config["chat_template"]},
        {"name": "other", "template": "unused"},
    ]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    ours = Tokenizer.from_dir(tmp_path)
    ref = transformers.PreTrainedTokenizerFast.from_pretrained(str(tmp_path))
    assert (ours.bos_token_id, ours.eos_token_id) == (ref.bos_token_id, ref.eos_token_id)
    assert ours.chat_template == config["chat_template"][0]["template"]
    for conversation in CONVERSATIONS:
        assert ours.apply_chat_template(conversation) == ref.apply_chat_template(
            conversation, add_generation_prompt=True, tokenize=False
        )
    assert ours.encode(TEXTS[1]) == ref.encode(TEXTS[1])


def test_chat_template_file_overrides_config(checkpoint: Path, tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((checkpoint / name).read_bytes())
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] | tojson }}\n{% endfor %}"
    (tmp_path / "chat_template.jinja").write_text(template, encoding="utf-8")
    ours = Tokenizer.from_dir(tmp_path)
    ref = transformers.PreTrainedTokenizerFast.from_pretrained(str(tmp_path))
    text = ours.apply_chat_template(CONVERSATIONS[2])
    assert text == ref.apply_chat_template(CONVERSATIONS[2], tokenize=False)
    assert text.splitlines()[2] == '[user] "Bonjour, ça va ?"'


def test_config_flags_used_without_post_processor(checkpoint: Path, tmp_path: Path) -> None:
    raw = json.loads((checkpoint / "tokenizer.json").read_text(encoding="utf-8"))
    raw["post_processor"] = None
    (tmp_path / "tokenizer.json").write_text(json.dumps(raw), encoding="utf-8")
    config = json.loads((checkpoint / "tokenizer_config.json").read_text(encoding="utf-8"))
    config["add_eos_token"] = True
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    ids = Tokenizer.from_dir(tmp_path).encode("hi")
    assert ids[0] == 508 and ids[-1] == 509 and len(ids) > 2
    del config["add_bos_token"], config["add_eos_token"]  # defaults: BOS yes, EOS no
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    ids = Tokenizer.from_dir(tmp_path).encode("hi")
    assert ids[0] == 508 and 509 not in ids


# --- IncrementalDetokenizer ---------------------------------------------------------------------


def _stream(tok: Tokenizer, ids: list[int], sizes: list[int], skip: bool) -> list[str]:
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    pieces, start = [], 0
    for size in sizes:
        pieces.append(detok.push(ids[start : start + size]))
        start += size
    assert start == len(ids)
    pieces.append(detok.flush())
    return pieces


def test_test_text_splits_characters(tok: Tokenizer) -> None:
    """Guard: single tokens of the test text decode to partial characters."""
    ids = tok.encode(MULTI_BYTE_TEXT)
    assert any("\ufffd" in tok.decode([i]) for i in ids)


@pytest.mark.parametrize("skip", [True, False])
def test_detokenizer_one_token_at_a_time(tok: Tokenizer, skip: bool) -> None:
    ids = tok.encode(MULTI_BYTE_TEXT) + [tok.eos_token_id or 0]
    pieces = _stream(tok, ids, [1] * len(ids), skip)
    assert all("\ufffd" not in piece for piece in pieces)
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=skip)
    expected = MULTI_BYTE_TEXT if skip else BOS_TOKEN + MULTI_BYTE_TEXT + EOS_TOKEN
    assert "".join(pieces) == expected
    assert pieces[-1] == ""  # nothing was left for flush


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_detokenizer_random_chunks(tok: Tokenizer, seed: int) -> None:
    ids = tok.encode(MULTI_BYTE_TEXT * 3)
    rng = random.Random(seed)
    sizes: list[int] = []
    while sum(sizes) < len(ids):
        sizes.append(min(rng.randint(0, 7), len(ids) - sum(sizes)))
    pieces = _stream(tok, ids, sizes, skip=True)
    assert all("\ufffd" not in piece for piece in pieces)
    assert "".join(pieces) == MULTI_BYTE_TEXT * 3


def test_detokenizer_window_stays_small(tok: Tokenizer) -> None:
    ids = tok.encode(MULTI_BYTE_TEXT * 20, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok)
    for token_id in ids:
        detok.push([token_id])
        assert len(detok._window_ids) <= 8  # bounded by the longest partial character
    assert detok.flush() == ""


def test_detokenizer_flush_returns_incomplete_tail(tok: Tokenizer) -> None:
    emoji_ids = tok.encode("🙂", add_special_tokens=False)
    assert len(emoji_ids) >= 2
    detok = IncrementalDetokenizer(tok)
    assert detok.push(tok.encode("ab", add_special_tokens=False)) == "ab"
    assert detok.push(emoji_ids[:-1]) == ""  # held back: half an emoji
    tail = detok.flush()
    assert tail == tok.decode(emoji_ids[:-1]) and tail.endswith("\ufffd")


# --- errors -------------------------------------------------------------------------------------


def test_missing_tokenizer_json(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "tokenizer.json")):
        Tokenizer.from_dir(tmp_path)


def test_no_chat_template(checkpoint: Path, tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_bytes((checkpoint / "tokenizer.json").read_bytes())
    ours = Tokenizer.from_dir(tmp_path)  # no tokenizer_config.json at all
    assert ours.chat_template is None and ours.bos_token_id is None
    with pytest.raises(ValueError, match="no chat template"):
        ours.apply_chat_template([{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match="empty conversation"):
        Tokenizer.from_dir(checkpoint).apply_chat_template([])
