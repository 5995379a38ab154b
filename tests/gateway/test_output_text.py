"""dsmesh.gateway.stop_strings.OutputText on DeepSeek-V3's real tokenizer: generated ids streamed
token by token become exactly the non-streamed text, never show half a character, and stop
at stop strings that span several tokens, even tokens that split one character."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from dsmesh.engine.tokenizer import Tokenizer
from dsmesh.gateway.stop_strings import OutputText
from tests.engine.deepseek_checkpoint import EOS_ID, write_deepseek_tokenizer

TEXT = "前言：🦜鹦鹉和🦩火烈鸟 fly over 北京 ☀️ — the END 🧑‍🚀 of 龘靐齉."


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_dir(write_deepseek_tokenizer(tmp_path_factory.mktemp("tok")))


def run(
    tok: Tokenizer, ids: list[int], stops: tuple[str, ...], sizes: list[int] | None = None
) -> tuple[list[str], bool]:
    """Push ``ids`` in chunks of ``sizes`` (default one by one) as the gateway does; return
    the pieces (``finish()`` last unless a stop string ended the stream) and whether one did."""
    output = OutputText(tok, stops)
    pieces, start = [], 0
    for size in sizes or [1] * len(ids):
        pieces.append(output.push(ids[start : start + size]))
        start += size
        if output.stopped:
            return pieces, True
    pieces.append(output.finish())
    return pieces, output.stopped


def test_no_stop_streams_the_exact_text(tok: Tokenizer) -> None:
    ids = [*tok.encode(TEXT), EOS_ID]
    pieces, stopped = run(tok, ids, ())
    assert not stopped and "".join(pieces) == TEXT == tok.decode(ids, skip_special_tokens=True)
    assert all("\ufffd" not in piece for piece in pieces)


@pytest.mark.parametrize(
    "stop",
    [
        "🦩",  # one character, three byte tokens
        "和🦩火",  # characters of different tokens, one of them split
        "鸟 fly",
        "END",
        "☀️ —",
        "齉.",
    ],
)
def test_stop_strings_spanning_tokens(tok: Tokenizer, stop: str) -> None:
    ids = tok.encode(TEXT)
    pieces, stopped = run(tok, ids, (stop, "never"))
    assert stopped
    assert "".join(pieces) == TEXT[: TEXT.index(stop)]
    assert all("\ufffd" not in piece for piece in pieces)


def test_stop_prefix_held_then_released(tok: Tokenizer) -> None:
    """Text that could start a stop string waits; once it cannot, it is shown, exactly."""
    ids = tok.encode(TEXT)
    pieces, stopped = run(tok, ids, ("🦩水", "END!"))
    assert not stopped and "".join(pieces) == TEXT
    # "🦩" is held while "水" could follow, and shown with the next character.
    emoji_end = next(i for i in range(len(ids)) if tok.decode(ids[: i + 1]).endswith("🦩"))
    assert "🦩" not in "".join(pieces[: emoji_end + 1])
    assert pieces[emoji_end + 1].startswith("🦩")


def test_stop_found_at_the_end_of_generation(tok: Tokenizer) -> None:
    ids = tok.encode("tail 🦜")
    output = OutputText(tok, ("🦜",))
    text = output.push(ids[:-1])  # the emoji's last byte token is still to come
    assert text == "tail " and not output.stopped
    assert output.push(ids[-1:]) == "" and output.stopped


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_chunks_equal_plain_find(tok: Tokenizer, seed: int) -> None:
    rng = random.Random(seed)
    ids = tok.encode(TEXT * 2)
    sizes: list[int] = []
    while sum(sizes) < len(ids):
        sizes.append(min(rng.randint(1, 4), len(ids) - sum(sizes)))
    start = rng.randrange(len(TEXT) - 3)
    stop = TEXT[start : start + rng.randint(1, 3)]
    pieces, stopped = run(tok, ids, (stop,), sizes)
    assert stopped and "".join(pieces) == (TEXT * 2)[: (TEXT * 2).index(stop)]


def test_folder_fixture_is_the_real_tokenizer(tok: Tokenizer, tmp_path: Path) -> None:
    assert tok.vocab_size == 128815 and tok.encode("🦩") == [3574, 102, 105]


@pytest.mark.parametrize("sizes", [None, [2, 5, 100]])
def test_min_tokens_text_is_not_searched_for_stop_strings(tok: Tokenizer, sizes) -> None:
    """The text of the first min_tokens tokens is shown as is; a stop string after it stops
    the stream, whether the pushes split at the boundary or straddle it."""
    ids = tok.encode("ab ab ab ab", add_special_tokens=False)
    first = len(tok.encode("ab ab", add_special_tokens=False))
    assert tok.decode(ids[:first]) == "ab ab"
    output = OutputText(tok, ("ab",), min_tokens=first)
    pieces, start = [], 0
    for size in sizes or [1] * len(ids):
        pieces.append(output.push(ids[start : start + size]))
        start += size
        if output.stopped:
            break
    assert output.stopped and "".join(pieces) == "ab ab "
    plain, stopped = run(tok, ids, ("ab",))
    assert stopped and "".join(plain) == ""
