"""Pure gateway policies: stop strings over streamed text, and (prefill, decode) routing."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from dsmesh.gateway.routing import DecodeLoad, PrefillLoad, choose_decode, choose_prefill
from dsmesh.gateway.stop_strings import StopStringMatcher


def run(stops: tuple[str, ...], pieces: list[str]) -> tuple[str, bool]:
    m = StopStringMatcher(stops)
    out = "".join(m.feed(p) for p in pieces)
    if not m.stopped:
        out += m.flush()
    return out, m.stopped


def test_stop_string_split_across_pieces() -> None:
    assert run(("END",), ["abc E", "N", "D tail"]) == ("abc ", True)
    assert run(("END",), ["abc EN", "x"]) == ("abc ENx", False)
    assert run(("\n\n", "###"), ["a\n", "b##", "#c"]) == ("a\nb", True)
    assert run((), ["a", "b"]) == ("ab", False)


@given(
    text=st.text(alphabet="abcE\nND", max_size=40),
    cuts=st.lists(st.integers(min_value=0, max_value=40), max_size=6),
    stop=st.sampled_from(["END", "\n", "aa", "Ea"]),
)
def test_stop_matcher_equals_plain_find(text: str, cuts: list[int], stop: str) -> None:
    bounds = sorted({0, len(text), *[min(c, len(text)) for c in cuts]})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    out, stopped = run((stop,), pieces)
    i = text.find(stop)
    assert (out, stopped) == ((text[:i], True) if i >= 0 else (text, False))


def test_routing_prefers_idle_prefill_and_roomy_decode() -> None:
    prefills = [PrefillLoad("p0", 500, 2), PrefillLoad("p1", 20, 5), PrefillLoad("p2", 20, 1)]
    assert choose_prefill(prefills).instance_id == "p2"
    decodes = [
        DecodeLoad("d0", 10, 100, 1),
        DecodeLoad("d1", 90, 100, 7),
        DecodeLoad("d2", 90, 100, 3),
    ]
    assert choose_decode(decodes).instance_id == "d2"
    assert choose_decode(decodes, pages_needed=95).instance_id == "d2"  # none fits: best effort
    assert choose_prefill([]) is None and choose_decode([]) is None


def test_decode_pages_are_accounted_from_the_page_size() -> None:
    assert DecodeLoad("d", 10, 10, 0, page_size=16).pages_for(33) == 3
    assert DecodeLoad("d", 10, 10, 0, page_size=1).pages_for(33) == 33
    assert DecodeLoad("d", 10, 10, 0).pages_for(33) == 1  # unknown page size: at least one
