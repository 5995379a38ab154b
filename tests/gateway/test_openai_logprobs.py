"""Logprobs in OpenAI's chat and completions shapes, with DeepSeek-V3's real tokenizer: token
strings, exact bytes (a character split over byte tokens joins back), text offsets."""

from __future__ import annotations

from pathlib import Path

import pytest

from dsmesh.engine.sampling.token_logprobs import TokenLogprobs
from dsmesh.engine.tokenizer import Tokenizer
from dsmesh.gateway.openai_logprobs import MIN_LOGPROB, LogprobsFormatter
from tests.engine.deepseek_checkpoint import write_deepseek_tokenizer
from tests.gateway.openai_reference import reference_text_offsets


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    folder: Path = write_deepseek_tokenizer(tmp_path_factory.mktemp("tok"))
    return Tokenizer.from_dir(folder)


def entries(ids: list[int]) -> list[TokenLogprobs]:
    return [
        TokenLogprobs(t, -0.5 * i, ((t, -0.5 * i), (ids[0], -float("inf"))))
        for i, t in enumerate(ids)
    ]


def test_chat_shape_and_bytes_rejoin_split_characters(tokenizer: Tokenizer) -> None:
    text = "你好 🦩!"
    ids = tokenizer.encode(text, add_special_tokens=False)
    out = LogprobsFormatter(tokenizer).chat(entries(ids))
    assert out["refusal"] is None and len(out["content"]) == len(ids)
    assert bytes(b for item in out["content"] for b in item["bytes"]).decode() == text
    first = out["content"][0]
    assert set(first) == {"token", "logprob", "bytes", "top_logprobs"}
    assert first["top_logprobs"][0] == {k: first[k] for k in ("token", "logprob", "bytes")}
    assert first["top_logprobs"][1]["logprob"] == MIN_LOGPROB  # -inf is not JSON
    for item in out["content"]:
        raw = bytes(item["bytes"])
        assert item["token"] == raw.decode("utf-8", errors="backslashreplace")


def test_completion_shape_and_offsets(tokenizer: Tokenizer) -> None:
    formatter = LogprobsFormatter(tokenizer)
    ids = tokenizer.encode("Hello world, hello", add_special_tokens=False)
    first = formatter.completion(entries(ids[:2]))
    rest = formatter.completion(entries(ids[2:]))  # streamed: offsets carry on
    tokens = first["tokens"] + rest["tokens"]
    assert "".join(tokens) == "Hello world, hello"
    offsets = first["text_offset"] + rest["text_offset"]
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    assert first["token_logprobs"] == [0.0, -0.5]
    # top tokens plus the generated one, keyed by text
    assert first["top_logprobs"][1] == {tokens[1]: -0.5, tokens[0]: MIN_LOGPROB}


def test_offsets_point_into_the_text(tokenizer: Tokenizer) -> None:
    """Escaped byte tokens, a character split over tokens and a skipped BOS leave every later
    offset where its token's text starts."""
    text = "Nice \u201cquotes\u201d: \u4f60\u597d \U0001f9a9 est!"
    ids = [tokenizer.bos_token_id, *tokenizer.encode(text, add_special_tokens=False)]
    out = LogprobsFormatter(tokenizer).completion(entries(ids))
    assert any(t.startswith("\\x") for t in out["tokens"])  # some tokens are partial characters
    assert out["text_offset"] == reference_text_offsets(tokenizer, ids)
    assert out["text_offset"][:2] == [0, 0]  # BOS is not in the text
    for token, offset in zip(out["tokens"], out["text_offset"], strict=True):
        if "\\x" not in token and token != tokenizer.bos_token:
            assert text[offset : offset + len(token)] == token
    assert text[out["text_offset"][-1] :] == out["tokens"][-1]


def test_special_tokens_show_their_text(tokenizer: Tokenizer) -> None:
    eos = tokenizer.eos_token_id
    assert eos is not None
    item = LogprobsFormatter(tokenizer).chat([TokenLogprobs(eos, -1.0)])["content"][0]
    assert item["token"] == tokenizer.eos_token and item["top_logprobs"] == []
